"""EAGLE-2 drafter: fc over [token embedding; target feature] -> one decoder layer -> the target's frozen LM head.

Feature = the target's last post-norm hidden state (what lm_head consumes). Context entry j pairs the embedding of
token j+1 (for media positions: the merged media embedding from prefill) with feature f_j and predicts f_{j+1}.
The drafter's KV only ever holds accepted context computed from the target's exact features; tree nodes live in a
per-cycle scratch KV, and each child is fed its parent's draft output as its feature (as in the authors' code).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel
from safetensors.torch import save_file
from torch import nn

from mmspec_ray.drafters.base import check_device, register_drafter
from mmspec_ray.drafters.files import DrafterError, TargetMismatch, parse_config, read_config, read_state
from mmspec_ray.drafters.layers import DecoderLayer, extend_mask
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, TreeSteps, grow_dynamic_tree

if TYPE_CHECKING:
    from mmspec_ray.drafters.facts import TargetFacts
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


class Eagle2Config(BaseModel):
    """Saved as the drafter's config.json; `target_*` fields guard against loading onto the wrong target."""

    method: str = "eagle2"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    qkv_bias: bool = False  # q/k/v with a bias (released heads of Qwen2 targets)
    input_norm: bool = False  # an input RMSNorm before attention (released MSD heads of Qwen2-VL have one)
    target_model_type: str = ""
    target_vocab_size: int = 0
    target_id: str = ""  # the identity of the checkpoint it was trained for ("": unknown, a model built in memory)

    @classmethod
    def for_target(cls, target: "VLMTarget") -> "Eagle2Config":
        tc = target.text_config
        heads = int(getattr(tc, "num_attention_heads", max(1, target.hidden_size // 64)))
        kv = int(getattr(tc, "num_key_value_heads", None) or heads)
        return cls(hidden_size=target.hidden_size, num_heads=heads, num_kv_heads=kv,
                   intermediate_size=int(getattr(tc, "intermediate_size", 4 * target.hidden_size)),
                   rope_theta=target_rope_theta(tc),
                   target_model_type=target.config.model_type, target_vocab_size=target.vocab_size,
                   target_id=target.identity or "")


def target_rope_theta(text_config) -> float:
    """The target's RoPE base: `rope_parameters["rope_theta"]` (transformers 5), else the older `rope_theta`, else
    10000. A head trained here rotates at its target's base."""
    params = getattr(text_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(text_config, "rope_theta", None) or 10000.0)


class Eagle2Head(nn.Module):
    """The trainable part (fc + one layer). Embeddings and LM head are the target's, passed in, never saved."""

    def __init__(self, cfg: Eagle2Config) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.layer = DecoderLayer(d, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.rope_theta,
                                  cfg.rms_eps, input_norm=cfg.input_norm, qkv_bias=cfg.qkv_bias)

    config_class: type[Eagle2Config] = Eagle2Config

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, at: int = 0,
                visual: torch.Tensor | None = None, step: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, feats [B, T, d]; pos [B, T]; mask [B, 1, T, at+T] bool -> predicted features [B, T, d]
        (`kv`/`at`: see DecoderLayer.forward). `visual` [B, T] bool (entry j's next token is a media token) is
        ignored here: EAGLE-2 fuses every entry; methods that treat media entries apart (MSD) override `inputs`.
        `step` [B, T] long: the drafting step whose feature an entry carries (0 or None: the target's; j: the
        drafter's own j-th guess, a tree node at level j), ignored here; HiViS overrides `with_step`."""
        return self.layer(self.with_step(self.inputs(embeds, feats, visual), step), pos, mask, kv, at)

    def inputs(self, embeds: torch.Tensor, feats: torch.Tensor, visual: torch.Tensor | None) -> torch.Tensor:
        """The decoder layer's input [B, T, d]: fc([embedding; feature]) at every entry."""
        return self.fc(torch.cat([embeds, feats], dim=-1))

    def with_step(self, x: torch.Tensor, step: torch.Tensor | None) -> torch.Tensor:
        """The layer input given each entry's drafting step: EAGLE-2 has no step signal (x unchanged)."""
        return x

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(path / "model.safetensors"))

    @classmethod
    def load(cls, path: str | Path) -> "Eagle2Head":
        """The head saved at `path`; a missing, unreadable or mismatched file refused in one line naming it."""
        path = Path(path)
        head = cls(parse_config(cls.config_class, path, read_config(path)))
        if not (path / "model.safetensors").exists():
            raise DrafterError(f"drafter {path} has no model.safetensors: copy it next to its config.json, or "
                               "train the drafter again")
        state = read_state(path, "model.safetensors")
        problem = state_problem(head, {k: tuple(v.shape) for k, v in state.items()})
        if problem:
            raise DrafterError(f"drafter {path}: model.safetensors {problem}")
        head.load_state_dict(state)
        return head


def state_problem(head: nn.Module, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How a saved state's keys and shapes differ from `head`'s (None: they agree), and what to do, in one line."""
    own = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing, extra = sorted(set(own) - set(shapes)), sorted(set(shapes) - set(own))
    bad = [f"{k} {list(shapes[k])} vs {list(own[k])}" for k in own if k in shapes and shapes[k] != own[k]]
    if not (missing or extra or bad):
        return None
    parts = [f"lacks {missing}"] if missing else []
    parts += [f"has weights {extra} its config does not"] if extra else []
    parts += [f"shapes differ: {'; '.join(bad)}"] if bad else []
    return ", ".join(parts) + " (weights and config.json of different drafters?): save the drafter again"


def check_fits(cfg: Eagle2Config, target: "VLMTarget | TargetFacts", path: str | Path | None = None) -> None:
    """A drafter trained for another target cannot run on `target` (a loaded target, or its facts read from the
    checkpoint's config): another hidden size or vocabulary, or (when both are known) another checkpoint identity.
    Say so with both sides, and what to do."""
    shapes = cfg.hidden_size != target.hidden_size or (cfg.target_vocab_size and
                                                       cfg.target_vocab_size != target.vocab_size)
    other = bool(cfg.target_id) and target.identity is not None and cfg.target_id != target.identity
    if shapes or other:
        model_type = getattr(target, "model_type", None) or target.config.model_type
        ids = f"checkpoint {cfg.target_id or 'unknown'} vs this target's {target.identity or 'unknown'}; "
        raise TargetMismatch(
            f"drafter{f' {path}' if path else ''} was trained for another target: {ids}hidden size / vocab "
            f"{cfg.hidden_size} / {cfg.target_vocab_size} ({cfg.target_model_type}) vs {target.hidden_size} / "
            f"{target.vocab_size} ({model_type}); train a drafter for this target with `mmspec train-drafter`")


@register_drafter("eagle2")
class Eagle2Drafter:
    """Per-request EAGLE-2 drafting state around a (frozen) head, bound to one target."""

    head_class: type[Eagle2Head] = Eagle2Head

    def __init__(self, head: Eagle2Head, target: "VLMTarget") -> None:
        check_fits(head.cfg, target)
        self.head = head.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # KV buffers [1, Hkv, capacity, hd]
        self.ctx_len = 0  # slots [0, ctx_len) hold accepted context; tree nodes use the slots after it
        self.last: torch.Tensor | None = None  # [1, d] draft output of the newest context entry
        self.passes = 0  # decoder forwards made while proposing (one per tree level; the engine's τ per pass)
        self.prefill_tokens = 0  # entries the last `begin` ran through the head (the drafter's prefill length)
        self.pos_offset = 0  # KV slot s has position id s + pos_offset (ViSpec: a compressed prefix keeps its ids)
        self._tree_out: list[torch.Tensor] = []  # while proposing: draft outputs of the expanded nodes, [k, d] a level

    @classmethod
    def load(cls, path: str | Path, target: "VLMTarget", device: str | None = None) -> "Eagle2Drafter":
        """Check the saved config against `target` (and `device` against the target's) before reading weights."""
        check_device(device, target)
        check_fits(parse_config(cls.head_class.config_class, Path(path), read_config(Path(path))), target, path)
        return cls(cls.head_class.load(path), target)

    @classmethod
    def random(cls, target: "VLMTarget", seed: int = 0, std: float = 0.02) -> "Eagle2Drafter":
        """An untrained drafter (tests: output must not depend on drafter quality). Every weight matrix and bias
        is drawn from `seed` alone (norm scales stay 1), so the same seed gives the same drafter whatever the
        global RNG holds."""
        g = torch.Generator().manual_seed(seed)
        head = cls.head_class(cls.head_class.config_class.for_target(target))
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.dim() > 1 or name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return cls(head, target)

    # ---------- lifecycle ----------
    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        self.ctx_len, self.last = 0, None
        embeds = self.prompt_embeds(prefill)[0]
        feats = self.features(prefill)[0]
        nxt = torch.cat([embeds[1:], self._embed([root])], 0)  # entry j: token j+1 with feature j
        media = prefill.media_mask
        visual = None if media is None else torch.cat([media[0, 1:], media.new_zeros(1)])  # token j+1 is media
        self._extend(nxt, feats, visual, self.prompt_positions(prefill))
        self.prefill_tokens = self.ctx_len

    def prompt_positions(self, prefill: "TargetOutput") -> torch.Tensor | None:
        """Position ids of the prompt's entries ([n], or [3, n] for M-RoPE heads); None: slot + `pos_offset`."""
        return None

    def features(self, out: "TargetOutput") -> torch.Tensor:
        """The target features this drafter reads from a forward's output, [1, n, D]: EAGLE-2's is the last
        post-norm hidden state. The engine hands `observe` these rows of each verify."""
        return out.hidden

    def prompt_embeds(self, prefill: "TargetOutput") -> torch.Tensor:
        """[1, n, d] the prompt's input embeddings as the drafter reads them: media positions carry the merged
        media embeddings (the target's own input)."""
        return prefill.inputs_embeds

    @torch.inference_mode()
    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """Append the accepted path (target features at root..last accepted) and the bonus as new context."""
        self._extend(self._embed(tokens[1:] + [bonus]), hidden.to(self.target.dtype))

    @torch.inference_mode()
    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        """EAGLE-2's dynamic tree from the newest context entry's draft output: one `_tree_step` forward per level
        (the one copy of the growth loop every tree drafter of this family shares)."""
        self._propose_setup(cfg)
        root_logp = self.logprobs(self.last)[0]
        tree = TreeSteps(self.ctx_len, self.target.device)

        def step(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            out = self._tree_step(tokens, parents, tree)
            self.passes += 1
            return self.logprobs(out).cpu()

        try:
            return grow_dynamic_tree(root, root_logp.cpu(), step, cfg)
        finally:
            self._tree_out = []  # the nodes' outputs are not needed after the tree is grown

    def _propose_setup(self, cfg: TreeConfig) -> None:
        """Before a tree's first level: scratch KV slots for every node after the context, and no node outputs yet."""
        self._reserve(self.ctx_len + cfg.top_k * cfg.depth)
        self._tree_out = []

    def _tree_step(self, tokens: torch.Tensor, parents: torch.Tensor, tree: TreeSteps) -> torch.Tensor:
        """One tree level: the new nodes (`tokens` [k], `parents` [k] among the expanded nodes, -1: the root) run
        in one forward over the context and their ancestors; returns their draft outputs [k, d]. EAGLE-2 feeds each
        node its parent's draft output as its feature (the root's: the newest context entry's)."""
        S, dev = tree.context, self.target.device
        all_out = torch.cat(self._tree_out, 0) if self._tree_out else None
        feats = torch.stack([self.last[0] if p < 0 else all_out[p] for p in parents.tolist()])
        n_prev, levels, mask, _ = tree.add(parents)
        pos = torch.tensor([[S - 1 + lv + self.pos_offset for lv in levels]], device=dev)
        out = self.head(self._embed(tokens.tolist())[None], feats[None], pos, mask[None, None], self.kv,
                        S + n_prev,  # scratch slots after the context; overwritten by the next cycle
                        step=torch.tensor([levels], device=dev))  # a level-j node's feature is a j-th guess
        self._tree_out.append(out[0])
        return out[0]

    def logprobs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft outputs [n, d] -> log-probabilities [n, V] over the target's vocabulary (float32): EAGLE-2 heads
        read them through the target's own LM head."""
        return torch.log_softmax(self.target.lm_head(out).float(), -1)

    # ---------- internals ----------
    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.target.embed_tokens(torch.tensor(ids, device=self.target.device)).to(self.target.dtype)

    def _reserve(self, n: int) -> None:
        """Make the KV buffers hold at least n slots (grown by doubling, so amortised O(1) per token)."""
        self.kv = self._grown(self.kv, n, self.ctx_len)

    def _grown(self, kv: "tuple[torch.Tensor, torch.Tensor] | None", n: int,
               used: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """K/V buffers [1, kv_heads, cap, head_dim] with cap >= n (doubling), the first `used` slots of `kv` kept."""
        if kv is not None and kv[0].shape[2] >= n:
            return kv
        cap = max(n, 2 * (kv[0].shape[2] if kv is not None else 256))
        cfg = self.head.cfg
        shape = (1, cfg.num_kv_heads, cap, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_heads)
        new = tuple(torch.empty(shape, dtype=self.target.dtype, device=self.target.device) for _ in range(2))
        if kv is not None and used:
            for dst, src in zip(new, kv):
                dst[:, :, :used] = src[:, :, :used]
        return new

    def _extend(self, embeds: torch.Tensor, feats: torch.Tensor, visual: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> None:
        """Run new context entries (embeds, feats [T, d]; visual [T] bool: the entry's next token is a media
        token) causally after the existing context; keep their KV. `pos` [T] (or [3, T], M-RoPE): their position
        ids (default: slot + `pos_offset`)."""
        S, mask, pos = self._after_context(embeds.shape[0], pos)
        out = self.head(embeds[None], feats[None], pos, mask, self.kv, S,
                        None if visual is None else visual[None].to(self.target.device))
        self.ctx_len = S + embeds.shape[0]
        self.last = out[0, -1:]

    def _after_context(self, T: int, pos: torch.Tensor | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Room for T new entries causally after the context (the one step every drafter's context extension
        shares): KV slots reserved, and (S = context length, the [1, 1, T, S+T] mask, position ids [1, T] or
        [3, 1, T]: `pos` [T] / [3, T] when given, else slot + `pos_offset`). The caller runs its layers from slot
        S and moves `ctx_len` past what it keeps."""
        S, dev = self.ctx_len, self.target.device
        self._reserve(S + T)
        pos = torch.arange(S, S + T, device=dev) + self.pos_offset if pos is None else pos.to(dev)
        return S, extend_mask(S, T, dev), pos.unsqueeze(-2)
