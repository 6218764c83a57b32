"""A drafter checked before any model loads: its files, config and weight headers, and (given a target's facts,
read from the checkpoint's config alone) whether it was made for that target. A batch job's driver runs this before
it writes anything, `mmspec generate` before the target loads and `mmspec drafter inspect` without a target, so a
broken or mismatched drafter is one line up front, not a traceback from every decoder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmspec_ray.drafters.base import check_drafter_files, drafter_class
from mmspec_ray.drafters.eagle import check_fits, state_problem
from mmspec_ray.drafters.facts import TargetFacts
from mmspec_ray.drafters.files import (DrafterError, TargetMismatch, first_line, parse_config, read_config,
                                      read_meta)
from mmspec_ray.drafters.released import ReleasedDrafter, recognise
from mmspec_ray.drafters.released_load import check_released

if TYPE_CHECKING:
    from mmspec_ray.config import S3Config

NO_FILES = ("none", "ngram", "suffix")  # drafters that are method names, not directories


def needs_check(spec: str | None) -> bool:
    """Whether `spec` may name a drafter directory (method names and draft models are checked where they load)."""
    return bool(spec) and spec not in NO_FILES and not spec.startswith(("ngram:", "draft-model:"))


def check_drafter(spec: str | None, facts: TargetFacts, s3: "S3Config | None" = None) -> None:
    """Refuse, in one line, a drafter directory or s3:// prefix that cannot run on the target of `facts`."""
    if not needs_check(spec):
        return
    from mmspec_ray.drafters.draft_model import is_draft_model_checkpoint

    if is_draft_model_checkpoint(spec, s3):  # a smaller VLM: its family is checked where it loads
        return
    if spec.startswith("s3://"):  # mirrored into the local cache, as load_drafter does
        from mmspec_ray.targets.registry import fetch_checkpoint

        spec = str(fetch_checkpoint(spec, s3, check=check_drafter_files, refresh=True))
    if not (Path(spec) / "config.json").exists():
        raise DrafterError(f"drafter {spec!r} is neither a method name (none, ngram, suffix), a draft model "
                           "(draft-model:PATH) nor a drafter checkpoint directory with config.json; train one with "
                           "`mmspec train-drafter`")
    check_dir(Path(spec), facts)


def check_dir(path: Path, facts: TargetFacts | None = None) -> ReleasedDrafter:
    """What the drafter directory `path` is, checked as far as `facts` allow (None: what needs no target)."""
    config = read_config(path)
    if not config.get("method"):
        return check_released(path, facts)
    check_own(path, config, facts)
    return recognise(path)


def check_own(path: Path, config: dict[str, Any], facts: TargetFacts | None) -> None:
    """This project's drafter: a known method, a whole model.safetensors, a config its head accepts, (with `facts`)
    the target it was trained for, and weights whose keys and shapes are the head's."""
    method = str(config["method"])
    try:
        cls = drafter_class(method)
    except ValueError as e:
        raise DrafterError(f"drafter {path}: config.json {e}") from None
    if not (path / "model.safetensors").exists():
        raise DrafterError(f"drafter {path} has no model.safetensors: copy it next to its config.json, or train the "
                           "drafter again")
    shapes = {k: tuple(v.shape) for k, v in read_meta(path, "model.safetensors").items()}
    head_class = getattr(cls, "head_class", None)
    if head_class is None:  # a corpus (suffix): its config names the target
        if facts is not None:
            _corpus_fits(path, config, facts)
        return
    cfg = parse_config(head_class.config_class, path, config)
    if facts is not None:
        check_fits(cfg, facts, path)
        layers = list(getattr(cfg, "feature_layers", None) or [])
        if any(not 0 <= k < facts.num_layers for k in layers):
            raise TargetMismatch(f"drafter {path} reads target layers {layers} (hidden_states indices), but the "
                                 f"target has {facts.num_layers} decoder layers; it was trained for another target: "
                                 "train a drafter for this one with `mmspec train-drafter`")
    try:
        with torch.device("meta"):
            head = head_class(cfg)
    except ValueError as e:
        raise DrafterError(f"drafter {path}: config.json does not describe a {method} head ({first_line(e)}): "
                           "save the drafter again") from None
    problem = state_problem(head, shapes)
    if problem:
        raise DrafterError(f"drafter {path}: model.safetensors {problem}")


def _corpus_fits(path: Path, config: dict[str, Any], facts: TargetFacts) -> None:
    """A drafter without a head (a suffix corpus) holds tokens of the target in its config: vocabulary, identity."""
    vocab, tid = config.get("target_vocab_size"), config.get("target_id")
    other = bool(tid) and facts.identity is not None and tid != facts.identity
    if (vocab and vocab != facts.vocab_size) or other:
        raise TargetMismatch(f"drafter {path} holds answers of another target (checkpoint {tid or 'unknown'}, "
                             f"vocabulary {vocab}) than {facts.name} ({facts.identity or 'unknown'}, "
                             f"{facts.vocab_size}); build it for this target with `mmspec train-drafter --method "
                             f"{config['method']}`")
