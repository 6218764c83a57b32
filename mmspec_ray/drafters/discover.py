"""Drafters found for a checkpoint: every trained drafter records the identity of the target it was trained for
(`config.json` `target_id`), so `--drafter auto` can look through drafter folders ($MMSPEC_HOME/drafters/ and any
`--drafter-dir`, local or s3://) and take the one trained for this very checkpoint that measured fastest (its
recorded held-out τ). Reads config.json and history.json only: no weights, no target."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mmspec_ray.config import S3Config, mmspec_home
from mmspec_ray.drafters.files import WEIGHT_FILES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoundDrafter:
    path: str  # the drafter's directory or s3:// prefix
    method: str
    target_id: str  # "" when it was trained before drafters recorded their target
    heldout_tau: float | None  # accepted draft tokens per cycle on held-out rows, as its training measured them


@dataclass(frozen=True)
class Skipped:
    path: str  # a folder that looks like a drafter but would not load
    why: str  # what is wrong with it, in a few words




@dataclass(frozen=True)
class DrafterChoice:
    spec: str  # what `load_drafter` takes: a method name or a drafter directory / s3:// prefix
    why: str  # one line for the plan and the logs


def home_drafters() -> str:
    """$MMSPEC_HOME/drafters: where `--drafter auto` always looks."""
    return str(mmspec_home() / "drafters")


def _tau(history: object) -> float | None:
    """The held-out τ a history.json records: a training job's summary, or the trainer's per-epoch list."""
    if isinstance(history, dict):
        value = history.get("heldout_tau")
    elif isinstance(history, list) and history and isinstance(history[-1], dict):
        value = history[-1].get("heldout_tau")
    else:
        value = None
    return float(value) if isinstance(value, (int, float)) and value == value else None


def scan(folder: str, s3: S3Config | None = None) -> tuple[list[FoundDrafter], list[Skipped]]:
    """The drafters in `folder` (each a sub-folder with config.json naming its method), or `folder` itself when it is
    one, and the folders that look like drafters but would not load: a config.json that is not a drafter's, or no
    weights (what an interrupted copy leaves). Cheap checks only (two small files and a listing). A folder that
    does not exist holds none."""
    from pyarrow import fs

    from mmspec_ray.media.io import filesystem_for

    filesystem, root = filesystem_for(folder, s3)
    try:
        infos = filesystem.get_file_info(fs.FileSelector(root, recursive=False, allow_not_found=True))
    except OSError as e:
        log.warning("cannot list drafter folder %s: %s", folder, e)
        return [], []
    dirs = [root] + sorted(i.path for i in infos if i.type == fs.FileType.Directory)
    found, skipped = [], []
    for d in dirs:
        path = f"s3://{d}" if folder.startswith("s3://") else d
        try:
            with filesystem.open_input_stream(f"{d}/config.json") as f:
                raw = f.read()
        except OSError:
            continue  # not a drafter folder
        try:
            cfg = json.loads(raw)
        except ValueError as e:
            skipped.append(Skipped(path, f"config.json is not JSON ({e})"))
            continue
        if not isinstance(cfg, dict) or not isinstance(cfg.get("method"), str) or not cfg["method"]:
            if isinstance(cfg, dict) and ("target_id" in cfg or "heldout_tau" in cfg):
                skipped.append(Skipped(path, "config.json names no method"))
            continue  # another model's config.json (a checkpoint folder, a released head)
        weights = [w for w in WEIGHT_FILES if _size(filesystem, f"{d}/{w}") > 0]
        if not weights:
            skipped.append(Skipped(path, f"no weights ({' or '.join(WEIGHT_FILES)} missing or empty: an interrupted "
                                   "copy?)"))
            continue
        try:
            with filesystem.open_input_stream(f"{d}/history.json") as f:
                tau = _tau(json.loads(f.read()))
        except (OSError, ValueError):
            tau = None
        found.append(FoundDrafter(path, str(cfg["method"]), str(cfg.get("target_id") or ""), tau))
    return found, skipped


def _size(filesystem, path: str) -> int:
    """Bytes of a file, 0 when it is absent or not a file."""
    from pyarrow import fs

    try:
        info = filesystem.get_file_info(path)
    except OSError:
        return 0
    return int(info.size or 0) if info.type == fs.FileType.File else 0


def choose_for(target_id: str, folders: list[str], s3: S3Config | None = None) \
        -> tuple[FoundDrafter | None, int, list[Skipped]]:
    """(the loadable drafter trained for `target_id` with the highest recorded held-out τ, or None; drafters looked
    at; folders skipped as drafters that would not load)."""
    seen: list[FoundDrafter] = []
    skipped: list[Skipped] = []
    for folder in folders:
        found, bad = scan(folder, s3)
        seen += found
        skipped += bad
    mine = [d for d in seen if d.target_id == target_id]
    best = max(mine, key=lambda d: (d.heldout_tau is not None, d.heldout_tau or 0.0), default=None)
    return best, len(seen), skipped


def train_command(target: str, data: str | None, max_new_tokens: int | None = None) -> str:
    """The one command that trains a drafter `--drafter auto` will find for `target`, runnable as printed: on `data`
    (the job's input), answered up to the job's `max_new_tokens`, its method chosen by `--method auto`'s rule."""
    name = Path(target.rstrip("/")).name or "target"
    tokens = f" --max-new-tokens {max_new_tokens}" if max_new_tokens else ""
    return (f"{cli_program()} train-drafter --method auto --target {target} --data {data or 'REQUESTS.parquet'}"
            f"{tokens} --out {home_drafters()}/{name}-auto")


def cli_program() -> str:
    """How to run the `mmspec` command here: `mmspec` where it is on PATH, else the entry point installed beside
    this Python (`.venv/bin/mmspec` in a checkout after scripts/bootstrap.sh, as the README runs it; relative to the
    current directory when under it), else `python -m mmspec_ray.cli` with this interpreter."""
    import os
    import shutil
    import sys

    if shutil.which("mmspec"):
        return "mmspec"
    beside = Path(sys.executable).parent / "mmspec"
    if os.access(beside, os.X_OK):
        return _short(beside)
    return f"{_short(Path(sys.executable))} -m mmspec_ray.cli"


def _short(path: Path) -> str:
    """`path` relative to the current directory when it lies under it (as the README writes `.venv/bin/mmspec`),
    else as it is."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
