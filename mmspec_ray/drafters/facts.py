"""What a drafter is checked against: a target's sizes, family, class and positions, taken from a loaded target or
from its checkpoint's config and safetensors headers alone (so a job can refuse a drafter before any model loads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmspec_ray.config import S3Config
    from mmspec_ray.targets.base import VLMTarget
    from mmspec_ray.targets.layout import CheckpointLayout


@dataclass
class TargetFacts:
    """The target dimensions and names a drafter must match."""

    name: str  # how messages name the target (its checkpoint, or its class for a model built in memory)
    hidden_size: int
    vocab_size: int
    num_layers: int
    model_types: tuple[str, ...]  # the VLM's model_type, then its language model's
    architectures: tuple[str, ...]  # the checkpoint's model classes (LlavaForConditionalGeneration, ...)
    mrope_section: list[int]  # [] for a target with 1-D RoPE
    identity_of: Callable[[], str | None] = field(default=lambda: None, repr=False)  # read only when a check needs it

    @property
    def model_type(self) -> str:
        return self.model_types[0] if self.model_types else "unknown"

    @property
    def identity(self) -> str | None:
        """The checkpoint's identity (`layout.checkpoint_identity`), read on first use; None where unknown."""
        if not hasattr(self, "_identity"):
            self._identity = self.identity_of()
        return self._identity


def facts_of(target: "VLMTarget") -> TargetFacts:
    """The facts of a loaded target."""
    tc = target.text_config
    archs = tuple(getattr(target.config, "architectures", None) or [type(target.model).__name__])
    name = str(getattr(target, "checkpoint", None) or type(target.model).__name__)
    return TargetFacts(name=name, hidden_size=target.hidden_size,
                       vocab_size=target.vocab_size, num_layers=int(getattr(tc, "num_hidden_layers", 1)),
                       model_types=_types(target.config.model_type, getattr(tc, "model_type", None)),
                       architectures=archs, mrope_section=mrope_section(tc),
                       identity_of=lambda: target.identity)


def facts_from_layout(layout: "CheckpointLayout", s3: "S3Config | None" = None) -> TargetFacts:
    """The facts of a checkpoint read from its config and tensor table (no weights): the vocabulary is the rows of
    its LM head (else of its token embeddings, else the config's `vocab_size`)."""
    full = layout.full_config()
    tc: dict[str, Any] = full.get("text_config") or full
    hidden = int(tc.get("hidden_size") or full.get("hidden_size") or 0)
    return TargetFacts(name=layout.uri, hidden_size=hidden, vocab_size=_vocab(layout, tc),
                       num_layers=int(tc.get("num_hidden_layers") or 1),
                       model_types=_types(layout.model_type, tc.get("model_type")),
                       architectures=tuple(layout.config.get("architectures") or ()),
                       mrope_section=mrope_section(SimpleNamespace(**tc)),
                       identity_of=lambda: _identity(layout, s3))


def mrope_section(text_config: Any) -> list[int]:
    """The target's M-RoPE sections from its text config (`rope_parameters`, or the older `rope_scaling`); [] for a
    target with 1-D RoPE."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    return [int(n) for n in rope.get("mrope_section") or []] if isinstance(rope, dict) else []


def _identity(layout: "CheckpointLayout", s3: "S3Config | None") -> str | None:
    """The checkpoint's identity, or None where it cannot be read (a drafter is then matched by shape only, as on a
    loaded target)."""
    from mmspec_ray.targets.layout import checkpoint_identity
    from mmspec_ray.targets.request import TargetError

    try:
        return checkpoint_identity(layout.uri, s3, layout)
    except (TargetError, OSError, ValueError, KeyError):
        return None


def _types(*names: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for n in names if n))


def _vocab(layout: "CheckpointLayout", tc: dict[str, Any]) -> int:
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        rows = [t.shape[0] for k, t in layout.tensors.items() if k.endswith(suffix) and "vision" not in k]
        if len(rows) == 1:
            return int(rows[0])
    return int(tc.get("vocab_size") or 0)
