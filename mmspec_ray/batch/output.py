"""The job's output directory: what it owns, what it already holds, and what produced it.

Safety rules (a job must never lose a user's data):
- One job per output at a time: the job holds the output's lease (batch/lease.py) before it reads or writes
  anything there.
- The job claims an output directory by writing a marker (`_mmspec_job.json`) before anything else; a directory
  that holds any file but no marker is refused, never written into or cleaned.
- The job only ever reads back, rewrites or deletes the parquet parts it wrote: the exact top-level file names (and
  sizes) the marker records for every run that ended, and, for a run that started but never ended (it crashed),
  the files named exactly as the writer names that run's parts (`mmspec-part-<run>_<write id>_<task>-<n>.parquet`,
  `.fix<N>` for a rewrite). Any other file there, a user's file named like a part included, is left alone and only
  reported.
- The marker records the settings that decide the output text and a fingerprint of each input file (size and
  modification time, or a content hash); a resume with other settings, or of an input that changed since, is
  refused (the changed rows can be decoded again on request: `redecode_changed`).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs
from ray.data.datasource import FilenameProvider

from mmspec_ray.batch.jobspec import REFUSAL_ONLY_MEDIA
from mmspec_ray.batch.lease import is_lease_file
from mmspec_ray.batch.storage import (SUMMARY_NAME, JobInputError, Location, canonical_uri, changed_names, exists,
                                      fingerprint_changes, read_json, same_input, write_json)
from mmspec_ray.media.io import is_transient

log = logging.getLogger(__name__)

MARKER_NAME = "_mmspec_job.json"
MEDIA_PRINTS_NAME = "_mmspec_media.parquet"  # --fingerprint-media's record (batch/media_prints.py)
PART_PREFIX = "mmspec-part-"
# `mmspec-part-<base>.parquet`, or `mmspec-part-<base>.fix<N>.parquet`: generation N of that part after a retry
# rewrote it without the rows being redone. Of one base only the highest generation is live.
_PART = re.compile(r"^mmspec-part-(?P<base>[A-Za-z0-9_\-]+?)(?:\.fix(?P<gen>\d+))?\.parquet$")
# Exactly what the writer names a run's parts: PartNames' `<run>_<write id: 32 hex>_<task: 6 digits>` and Ray
# Data's `-<file index>` (absent in older Ray versions), then a rewrite's `.fix<N>`.
_WRITTEN = re.compile(r"^mmspec-part-(?P<run>[0-9A-Za-z]+)_[0-9a-f]{32}_\d{6}(?:-\d+)?"
                      r"(?:\.fix\d+)?\.parquet$")
# 3: the exact names and sizes of the parts of each run that ended (`parts`, `sealed`);
# 2: run tokens and input fingerprints; 1: parts recognised by name. Older markers are upgraded on resume.
MARKER_FORMAT = 3
_READ_TRIES = 4  # a transiently failing part read: 4 tries over ~7 s, then the job stops (deleting nothing)
# Settings that may differ on a resume when decoding is greedy: they change speed (or unused sampling knobs),
# never the text.
GREEDY_FREE = ("drafter", "tree", "tie_margin", "top_p", "top_k", "min_p", "seed")


class PartNames(FilenameProvider):
    """Ray Data file names of one run's output parts: `mmspec-part-<run>_<write uuid>_<task>.parquet`, `run` being
    the token this run recorded in the marker before writing (how the job knows a part is its own)."""

    def __init__(self, run: str) -> None:
        super().__init__(file_format="parquet")
        self.run = run

    def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
        return f"{PART_PREFIX}{self.run}_{write_uuid.replace('-', '')}_{task_index:06}.parquet"


def new_run_token() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class OutputState:
    """What an output directory already holds."""

    files: list[str]  # live parts written by the job
    ids: pa.Array  # ids of rows already written (duplicates kept, so they can be reported)
    removed: list[str]  # the job's own parts deleted: unreadable (a write cut off by a crash) or superseded
    foreign: list[str]  # files the job did not write (left alone)
    record: dict[str, Any] = field(default_factory=dict)  # the marker the parts were told by
    sizes: dict[str, int] = field(default_factory=dict)  # size of each live part, by path


@dataclass(frozen=True)
class Claim:
    """A claimed output: the marker's record, and the input files changed since it was made (lines saying how;
    empty for a new output or an unchanged input)."""

    record: dict[str, Any]
    changed: list[str]
    changed_files: list[str]  # their names (as `input_fingerprints` records them): new, gone or changed


def _parse(path: str) -> tuple[str, int] | None:
    m = _PART.match(path.rsplit("/", 1)[-1])
    return (m["base"], int(m["gen"] or 0)) if m else None


def _listing(loc: Location) -> list[pafs.FileInfo]:
    if not exists(loc):
        return []
    return [i for i in loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True)) if i.type == pafs.FileType.File]


def _is_top(loc: Location, path: str) -> bool:
    return "/" not in path[len(loc.path):].strip("/")


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def owns(loc: Location, record: dict[str, Any], path: str, size: int | None = None) -> bool:
    """Whether `path` (of `size` bytes) is a part this job wrote: at the top level, and either a name the marker
    records (at that size; a pending rewrite records none), or named exactly as the writer names the parts of a
    run the marker lists as started but not ended (a crashed run, or this one). A token inside another name, such as
    a user's `mmspec-part-<run>_backup.parquet`, is not the job's."""
    if not _is_top(loc, path):
        return False
    name = _name(path)
    parts = record.get("parts") or {}
    if name in parts:
        return parts[name] is None or size is None or parts[name] == size
    m = _WRITTEN.match(name)
    return bool(m) and m["run"] in record.get("runs", ()) and m["run"] not in record.get("sealed", ())


def _job_file(name: str) -> bool:
    """The marker, the summary and the lease: the job's own bookkeeping, never parts and never foreign."""
    return name in (MARKER_NAME, SUMMARY_NAME, MEDIA_PRINTS_NAME) or is_lease_file(name)


def check_output_dir(loc: Location) -> None:
    """An output must be a directory (or not exist yet): an existing file there is refused before anything else."""
    if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
        raise JobInputError(f"output {loc.uri} is a file; give a directory (new or this job's) for the output")


def claim(loc: Location, settings: dict[str, Any], input_uri: str,
          fingerprints: dict[str, dict[str, Any]] | None = None, overwrite: bool = False,
          redecode_changed: bool = False, dry_run: bool = False) -> Claim:
    """Claim `loc` for a job reading `input_uri` with `settings` (writing the marker), or check that a resume is the
    same job: same input (any spelling of its URI, or the same files elsewhere: `same_input`; ids of another dataset
    would pass as done), same text-deciding settings, and input files
    unchanged since the marker recorded their `fingerprints` (else refused, or with `redecode_changed` returned as
    `Claim.changed` for the caller to decode their rows again before `record_run` records the new fingerprints).

    Refuses (JobInputError) a directory holding files but no marker, a resume of another input, and one whose
    settings differ in a way that changes the text. With `overwrite`, the job's own files are deleted first
    (foreign ones never), but only for the same input: another job's answers are not this job's to delete.
    `dry_run`: every check, nothing written or deleted (`--dry-run` refuses what the run would)."""
    check_output_dir(loc)
    marker = loc.child(MARKER_NAME)
    files = [i for i in _listing(loc) if not (_is_top(loc, i.path) and is_lease_file(_name(i.path)))]
    has_marker = any(i.path.rstrip("/") == marker.path for i in files)
    if files and not has_marker:
        sample = ", ".join(i.path.rsplit("/", 1)[-1] for i in files[:3])
        raise JobInputError(f"output {loc.uri} already holds {len(files)} file(s) (e.g. {sample}) that this job did "
                            "not write (no _mmspec_job.json marker); choose a new or empty output directory")
    record = _upgrade(loc, _read_json(marker), files) if has_marker else {}
    if has_marker and not same_input(record.get("input"), record.get("input_files"), input_uri, fingerprints,
                                     copy_changed=redecode_changed):
        raise JobInputError(f"output {loc.uri} holds the answers of another job (input {record.get('input')!r}); "
                            f"this job reads {canonical_uri(input_uri)!r}, whose files differ. Use a new --output "
                            "for it, or --redecode-changed if it is a copy of that input with some of its files changed (at least "
                            "half unchanged)")
    if has_marker and overwrite and dry_run:
        return Claim(record, [], [])  # a run deletes the job's own files and starts over: nothing else to check
    if has_marker and overwrite:
        own = [i.path for i in files if owns(loc, record, i.path, i.size) or
               (_is_top(loc, i.path) and _name(i.path) in (SUMMARY_NAME, MEDIA_PRINTS_NAME))]
        for p in own:
            loc.fs.delete_file(p)
        loc.fs.delete_file(marker.path)
        log.info("--overwrite: deleted %d files this job wrote in %s", len(own), loc.uri)
        has_marker = False
    if has_marker:
        diff = settings_diff(record.get("settings", {}), settings)
        if diff:
            raise JobInputError(f"output {loc.uri} was made with other decoding settings ({'; '.join(diff)}); a "
                                "resume would mix answers of both. Use a new --output, the old settings, or "
                                "--overwrite to start over")
        old = record.get("input_files")
        changed = fingerprint_changes(old, fingerprints) if old is not None and fingerprints is not None else []
        if changed and not redecode_changed:
            raise JobInputError(
                f"the input changed since output {loc.uri} was made ({'; '.join(changed[:5])}"
                f"{f'; {len(changed) - 5} more' if len(changed) > 5 else ''}): a resume would keep answers to the old "
                "rows. Re-run with --redecode-changed to decode the rows of the changed files again (and drop rows "
                "no longer in the input), or use a new --output, or --overwrite to start over")
        names = changed_names(old, fingerprints) if changed else []
        return Claim(record, changed, names)
    if dry_run:
        return Claim({}, [], [])
    record = {"format": MARKER_FORMAT, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "input": canonical_uri(input_uri), "input_files": fingerprints, "settings": settings, "runs": [],
              "sealed": [], "parts": {}}
    write_json(marker, record)
    return Claim(record, [], [])


def record_run(loc: Location, record: dict[str, Any], run: str,
               fingerprints: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Add this run's token (before it writes any part) and the input's current fingerprints to the marker."""
    record = {**record, "runs": [*record.get("runs", []), run]}
    if fingerprints is not None:
        record["input_files"] = fingerprints
    write_json(loc.child(MARKER_NAME), record)
    return record


def _upgrade(loc: Location, record: dict[str, Any], files: list[pafs.FileInfo]) -> dict[str, Any]:
    """An older marker as the current format. Format 1 (parts recognised by name, no input fingerprints): the
    parts named like the job's present now are recorded as its own, by name and size; the input's fingerprints are
    recorded by this run. Format 2 (run tokens): its runs count as not ended, so their parts are told by the
    writer's exact naming until this run ends and records them; the parts format 1 left (`legacy_parts`, by base
    name) are recorded by name and size."""
    fmt = record.get("format", 1)
    if fmt >= 3:
        return record
    top = [i for i in files if _is_top(loc, i.path) and _parse(i.path)]
    legacy = set(record.get("legacy_parts", ())) if fmt == 2 else {_parse(i.path)[0] for i in top}
    parts = {_name(i.path): i.size for i in top if _parse(i.path)[0] in legacy}
    log.info("output %s: marker from an earlier version (format %d); %d parts named like the job's are taken as its "
             "own", loc.uri, fmt, len(parts))
    out = {k: v for k, v in record.items() if k != "legacy_parts"}
    return {**out, "format": MARKER_FORMAT, "runs": record.get("runs", []) if fmt == 2 else [], "sealed": [],
            "parts": parts}


def seal(loc: Location, record: dict[str, Any], state: OutputState) -> dict[str, Any]:
    """Record the end of every run so far: the job's live parts by exact name and size (from now on the only files
    of these runs it owns; a copy of one under another name, or a file put in its place, is not the job's)."""
    record = {**record, "sealed": list(record.get("runs", [])),
              "parts": {_name(p): state.sizes.get(p) for p in state.files}}
    write_json(loc.child(MARKER_NAME), record)
    return record


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs and can change the output text. The drafter, tree and
    sampling knobs cannot at temperature 0 in float32; in half precision a drafter can (docs/design.md, Precision)."""
    greedy = (old.get("temperature", 0.0) == 0.0 and new.get("temperature", 0.0) == 0.0
              and old.get("dtype", "float32") == new.get("dtype", "float32") == "float32")
    out = []
    for key in sorted(set(old) | set(new)):
        if greedy and key in GREEDY_FREE:
            continue
        a, b = old.get(key), new.get(key)
        if key == "media":  # (markers written before the refusal-only bounds were left out still carry them)
            a, b = ({k: v for k, v in m.items() if k not in REFUSAL_ONLY_MEDIA} if isinstance(m, dict) else m
                    for m in (a, b))
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def scan(loc: Location, record: dict[str, Any], columns: list[str] | None = None) -> tuple[OutputState,
                                                                                           pa.Table | None]:
    """Read the ids (and `columns`) of the job's live parts (`owns`: by the marker's `record`). The job's own torn
    parts (a local write cut off by a crash: bad parquet magic or footer) and superseded generations are deleted, so
    their rows are simply done again. A read error is retried when transient and otherwise stops the job; it never
    deletes anything. Every other file is left alone."""
    infos = _listing(loc)
    mine: dict[str, list[tuple[int, str]]] = {}
    foreign = []
    for i in infos:
        parsed = _parse(i.path)
        if parsed and owns(loc, record, i.path, i.size):
            mine.setdefault(parsed[0], []).append((parsed[1], i.path))
        elif not (_is_top(loc, i.path) and _job_file(_name(i.path))):
            foreign.append(i.path)
    if foreign:
        log.warning("output %s holds %d file(s) this job did not write (e.g. %s): ignored, left in place", loc.uri,
                    len(foreign), foreign[0])
    cols = ["id"] + [c for c in (columns or []) if c != "id"]

    def read(path: str) -> pa.Table | None:
        for attempt in range(_READ_TRIES):
            try:
                part = pq.ParquetFile(path, filesystem=loc.fs)
                have = part.schema_arrow.names
                t = part.read(columns=[c for c in cols if c in have])
                for c in cols:  # a part written before a column existed: nulls, never a reason to delete it
                    if c not in have:
                        t = t.append_column(c, pa.nulls(t.num_rows))
                return t
            except pa.ArrowInvalid as e:  # bad magic / footer: the file itself is damaged
                if loc.is_s3:  # S3 never shows a partial object: not a torn write, so not ours to delete
                    raise JobInputError(f"output part s3://{path} is not valid parquet ({e}); inspect it, and "
                                        "delete it by hand to have its rows decoded again") from e
                log.warning("output part %s is torn (%s): deleting it; its rows will be decoded again", path, e)
                loc.fs.delete_file(path)
                return None
            except OSError as e:
                if not is_transient(e) or attempt == _READ_TRIES - 1:
                    raise JobInputError(f"cannot read output part {path} ({e}); nothing was deleted: re-run when "
                                        "the store is reachable") from e
                time.sleep(2.0 ** attempt)
        return None

    def newest_readable(chain: list[str]) -> tuple[str | None, pa.Table | None]:
        """A part's generations, newest first: the first that reads is live (a torn newer one was deleted by
        `read`: its older generation still holds the rows, those a crashed rewrite meant to drop included, which
        the same re-run drops again)."""
        for path in chain:
            t = read(path)
            if t is not None:
                return path, t
        return None, None

    chains = [[p for _, p in sorted(gens, reverse=True)] for _, gens in sorted(mine.items())]
    with ThreadPoolExecutor(max_workers=8) as pool:
        found = list(pool.map(newest_readable, chains))
    removed, good, parts = [], [], []
    for chain, (path, t) in zip(chains, found):
        at = chain.index(path) if path is not None else len(chain)
        removed += chain[:at]  # torn newer generations (deleted by `read`)
        for old in chain[at + 1:]:  # superseded by the live one: deleted only now that it reads
            loc.fs.delete_file(old)
            removed.append(old)
        if path is not None:
            good.append(path)
            parts.append(t)
    table = pa.concat_tables(parts, promote_options="permissive") if parts else None
    ids = table.column("id").combine_chunks() if table is not None else pa.array([], type=pa.string())
    live = set(good)
    sizes = {i.path: i.size for i in infos if i.path in live}
    return OutputState(good, ids, removed, foreign, record, sizes), table


def drop_rows(loc: Location, state: OutputState, ids: pa.Array) -> int:
    """Take the rows `ids` out of the output so that this run decodes them again; every other row stays as it was
    (not decoded again). See `_rewrite`."""
    drop = {}
    for path in state.files:
        got = pq.read_table(path, columns=["id"], filesystem=loc.fs).column("id")
        drop[path] = pc.is_in(got, value_set=ids.cast(got.type)).combine_chunks()
    return _rewrite(loc, state, drop)


def drop_duplicates(loc: Location, state: OutputState) -> int:
    """Keep one row per id in the job's live parts, dropping the others (two jobs that wrote into one output both
    answered those rows; each copy lies in a part the job owns, so each is provably the job's). The row kept is a
    successful one where there is one, else the first, in part order."""
    counts = pc.value_counts(state.ids)
    dups = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if not len(dups):
        return 0
    kept: dict[Any, tuple[str, int, bool]] = {}  # id -> (part, row, ok) of the copy kept so far
    tables = {}
    for path in state.files:
        have = pq.ParquetFile(path, filesystem=loc.fs).schema_arrow.names
        t = pq.read_table(path, columns=[c for c in ("id", "error_kind") if c in have], filesystem=loc.fs)
        tables[path] = t
        ok = t.column("error_kind").is_null().to_pylist() if "error_kind" in have else [True] * t.num_rows
        hit = pc.is_in(t.column("id"), value_set=dups.cast(t.column("id").type)).to_pylist()
        for row, (rid, good, dup) in enumerate(zip(t.column("id").to_pylist(), ok, hit)):
            if dup and (rid not in kept or (good and not kept[rid][2])):
                kept[rid] = (path, row, good)
    keep_rows: dict[str, set[int]] = {}
    for path, row, _ in kept.values():
        keep_rows.setdefault(path, set()).add(row)
    drop = {}
    for path, t in tables.items():
        hit = pc.is_in(t.column("id"), value_set=dups.cast(t.column("id").type)).to_pylist()
        drop[path] = pa.array([h and r not in keep_rows.get(path, ()) for r, h in enumerate(hit)], pa.bool_())
    n = _rewrite(loc, state, drop)
    log.warning("output %s held %d duplicate rows of %d ids, all in parts this job wrote (two jobs wrote into it at "
                "once): dropped, one row per id kept", loc.uri, n, len(dups))
    return n


def _rewrite(loc: Location, state: OutputState, drop: dict[str, pa.Array]) -> int:
    """Drop the rows `drop[path]` flags from each live part: a part holding some is rewritten as its next
    generation, then the old one deleted (a crash in between leaves both, and the next scan keeps the newer one).
    The marker records each new name before it is written and its size after, so the job still owns it."""
    hits = {p: int(pc.sum(m).as_py() or 0) for p, m in drop.items() if p in state.files}
    hits = {p: n for p, n in hits.items() if n}
    if not hits:
        return 0
    keeps = {p: pq.read_table(p, filesystem=loc.fs).filter(pc.invert(drop[p])) for p in hits}
    new = {p: _next_generation(loc, p) for p, t in keeps.items() if t.num_rows}
    record = state.record
    if record:
        record = _record_parts(loc, record, {_name(n): None for n in new.values()}, [])
    sizes = {}
    for p in hits:
        if p in new:
            with loc.fs.open_output_stream(new[p]) as f:
                pq.write_table(keeps[p], f)
            sizes[_name(new[p])] = loc.fs.get_file_info(new[p]).size
        loc.fs.delete_file(p)
    if record:
        _record_parts(loc, record, sizes, [_name(p) for p in hits])
    return sum(hits.values())


def _next_generation(loc: Location, path: str) -> str:
    """The name of a part's next generation, past any file already there (never written over)."""
    base, gen = _parse(path)
    while True:
        gen += 1
        new = f"{path.rsplit('/', 1)[0]}/{PART_PREFIX}{base}.fix{gen}.parquet"
        if loc.fs.get_file_info(new).type == pafs.FileType.NotFound:
            return new


def _record_parts(loc: Location, record: dict[str, Any], add: dict[str, int | None],
                  remove: list[str]) -> dict[str, Any]:
    """Write the marker with the part names `add` recorded (size None: being written) and `remove` forgotten."""
    parts = {k: v for k, v in (record.get("parts") or {}).items() if k not in remove}
    record = {**record, "parts": {**parts, **add}}
    write_json(loc.child(MARKER_NAME), record)
    return record


def read_marker(loc: Location) -> dict[str, Any]:
    """The job marker of output directory `loc` (what `scan` needs to tell the job's parts)."""
    return _read_json(loc.child(MARKER_NAME))


def _read_json(loc: Location) -> dict:
    try:
        return read_json(loc)
    except (OSError, ValueError) as e:
        raise JobInputError(f"cannot read the job marker {loc.uri} ({e}); restore it, or use a new --output") from e
