"""The Drafter protocol and registry. A drafter proposes a token tree; the engine verifies it on the target.

Lifecycle per request: `begin(target, prefill, root)` -> repeat { `propose(root, cfg)` -> verify -> accept ->
`observe(tokens, hidden, bonus)` }. `observe` receives the accepted path's tokens (root first) and the target's
exact hidden states at those nodes, so a drafter's context holds target features, never its own guesses.

Optional attribute `prefill_logits: int` (default 1): how many of the last prompt positions' logits the drafter
needs from the prefill (0: all of them). The target computes no others, since [L, V] logits of a long prompt cost
gigabytes.

Optional attribute `prefill_attention: bool` (default False): the drafter reads the target's last-layer attention
received per prompt position (`TargetOutput.attention_received`, DREAM's visual token compression); the engine asks
the target's prefill for it.

Optional method `features(out: TargetOutput) -> Tensor [1, n, D]` (default: `out.hidden`): the target features the
drafter reads; the engine hands `observe` these rows of each verify (EAGLE-3: three layers' states, concatenated).

Optional method `finish(answer: list[int])`: the request's whole answer (token ids, the first generated one first)
when its decoding runs to completion (not when a stream is closed early or fails), whether or not the drafter was
begun (the suffix drafter adds it to its corpus).

Optional attribute `prefill_tokens: int` (default 0), set by `begin`: how many entries the drafter's own prefill
read (EAGLE-2: the whole prompt, media included; HiViS: its text only). The engine reports it per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mmspec_ray.decoding.tree import DraftTree, TreeConfig

if TYPE_CHECKING:
    from pathlib import Path

    from mmspec_ray.config import S3Config
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


@runtime_checkable
class Drafter(Protocol):
    name: str

    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Build per-request state from the target's prefill; `root` is the first generated token."""

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        """A tree rooted at `root` (the last committed token, not yet verified)."""

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """After verification: accepted path tokens (root first), target hidden [len(tokens), d], next root."""


def stop_learning(drafter: object) -> bool:
    """Turn off a drafter's learning from the answers it decodes (the suffix drafter's `cfg.learn`), for measurements
    that decode a prompt more than once or must describe the drafter as built; True when there was any to stop."""
    cfg = getattr(drafter, "cfg", None)
    if not getattr(cfg, "learn", False):
        return False
    drafter.cfg = cfg.model_copy(update={"learn": False})
    return True


def target_features(drafter: object, out: "TargetOutput") -> torch.Tensor:
    """[1, n, D] the features of a target forward that `drafter` observes (its `features`, else the last hidden)."""
    fn = getattr(drafter, "features", None)
    return out.hidden if fn is None else fn(out)


# method name -> the module that defines (and registers) its drafter class: imported on first use, so this
# protocol file never imports its implementations
MODULES: dict[str, str] = {
    "eagle2": "mmspec_ray.drafters.eagle",
    "eagle3": "mmspec_ray.drafters.eagle3",
    "hivis": "mmspec_ray.drafters.hivis",
    "msd": "mmspec_ray.drafters.msd",
    "specflash": "mmspec_ray.drafters.specflash",
    "vispec": "mmspec_ray.drafters.vispec",
    "dream": "mmspec_ray.drafters.dream",
    "ngram": "mmspec_ray.drafters.ngram",
    "suffix": "mmspec_ray.drafters.suffix",
    "draft-model": "mmspec_ray.drafters.draft_model",
    "none": "mmspec_ray.drafters.none",
    "oracle": "mmspec_ray.drafters.oracle",
}
_REGISTRY: dict[str, type] = {}
RELEASED_MODULE = "mmspec_ray.drafters.released_load"  # heads in their authors' layouts (EAGLE-1/2/3, SpecForge)


def register_drafter(name: str):
    """Class decorator: the drafter class of method `name` (its module must be listed in MODULES)."""

    def deco(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def drafter_class(name: str) -> type:
    """The drafter class of method `name`, importing its module on first use."""
    import importlib

    if name not in MODULES:
        raise ValueError(f"unknown drafter method {name!r}; choose one of {sorted(MODULES)}")
    if name not in _REGISTRY:
        importlib.import_module(MODULES[name])
    return _REGISTRY[name]


def check_device(device: str | torch.device | None, target: "VLMTarget") -> None:
    """A drafter runs on its target's device (it shares the target's embeddings, LM head and features); refuse a
    `device` that names another one instead of ignoring it ("cuda" matches a target on "cuda:0")."""
    if device is None:
        return
    want, have = torch.device(device), target.device
    if want.type != have.type or (want.index is not None and have.index is not None and want.index != have.index):
        raise ValueError(f"drafter device {want} differs from the target's device {have}; a drafter runs on its "
                         "target's device (load the target there, or leave the drafter's device unset)")


def check_drafter_files(path: "Path") -> None:
    """A drafter checkpoint directory holds config.json and its weights (model.safetensors; released EAGLE heads
    may hold pytorch_model.bin)."""
    from mmspec_ray.targets.base import TargetError

    missing = [f for f in ("config.json",) if not (path / f).exists()]
    from mmspec_ray.drafters.files import WEIGHT_FILES

    if not any((path / f).exists() for f in WEIGHT_FILES):
        missing.append("model.safetensors (or a released head's pytorch_model.bin)")
    if missing:
        raise TargetError(f"drafter checkpoint {path} has no {' or '.join(missing)}; train one with "
                          "`mmspec train-drafter`")


def load_drafter(spec: str | None, target: "VLMTarget", device: str | None = None,
                 s3: "S3Config | None" = None) -> Drafter:
    """A ready drafter for `target` from a method name ("none", "ngram", "ngram:N" for a shortest match of N
    tokens, "suffix": the suffix drafter with an empty corpus, learning from the answers it sees), a draft model ("draft-model:PATH", or a bare PATH holding a VLM checkpoint of a supported family with
    its processor: a smaller sibling of the target, loaded on the target's device and dtype) or a trained drafter
    checkpoint directory
    or s3:// prefix (`config.json` naming its `method` + `model.safetensors`, or a released head in a layout
    `drafters.released` recognises). None or "" means no drafter (plain AR decoding).
    `device`, when given, must be the target's (see `check_device`); `s3`: the endpoint of an s3:// drafter
    (default: from the environment)."""
    from pathlib import Path

    check_device(device, target)
    if not spec or spec == "none":
        return drafter_class("none")()
    if spec == "ngram" or spec.startswith("ngram:"):  # "ngram:N": prompt lookup needing a match of N tokens
        n = spec.partition(":")[2]
        if n and not n.isdigit():
            raise ValueError(f"drafter {spec!r}: ngram:N takes the shortest match length N as a whole number")
        return drafter_class("ngram")(**({"min_ngram": int(n), "max_ngram": max(3, int(n))} if n else {}))
    if spec == "suffix":
        return drafter_class("suffix")()
    draft_model = drafter_class("draft-model")
    if spec.startswith("draft-model:") or draft_model.is_checkpoint(spec, s3):  # a smaller VLM of the same family
        path = spec.removeprefix("draft-model:")
        if not path:
            raise ValueError("drafter 'draft-model:' names no checkpoint; give draft-model:PATH (a directory or "
                             "s3:// prefix of a smaller checkpoint of the target's family)")
        return draft_model.load(path, target, device=device, s3=s3)
    if spec.startswith("s3://"):  # mirrored once into the local checkpoint cache, as targets are
        from mmspec_ray.targets.registry import fetch_checkpoint

        spec = str(fetch_checkpoint(spec, s3, check=check_drafter_files, refresh=True))  # small; may be re-published
    path = Path(spec)
    if not (path / "config.json").exists():
        raise ValueError(f"drafter {spec!r} is neither a method name (none, ngram), a draft model "
                         "(draft-model:PATH) nor a drafter checkpoint directory with config.json; train one with "
                         "`mmspec train-drafter`")
    from mmspec_ray.drafters.files import read_config

    method = read_config(path).get("method")
    if not method:  # a head as its authors published it (EAGLE-1/2/3, SpecForge): recognised by its files
        import importlib

        released = importlib.import_module(RELEASED_MODULE)  # by name, as the methods' modules (no import circle)
        check_device(device, target)
        return released.load_released(released.recognise(path), target)
    cls = drafter_class(method)
    if not hasattr(cls, "load"):
        raise ValueError(f"drafter method {method!r} in {path} cannot be loaded from a checkpoint")
    return cls.load(path, target, device=device)
