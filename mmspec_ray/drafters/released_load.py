"""Released drafter heads (layouts recognised by released.py) mapped onto the drafter of their method, every weight
accounted for. The same mapping runs on the meta device to check a head without loading it (`check_released`:
`mmspec drafter inspect` and a job's driver), so a missing or unused weight, a shape that differs from the config
and a broken `d2t` are refused with or without a target."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmspec_ray.drafters.facts import TargetFacts, facts_of
from mmspec_ray.drafters.files import DrafterError, first_line, read_state
from mmspec_ray.drafters.released import ReleasedDrafter, aux_layers, check_target, recognise, rope_base, rope_of

if TYPE_CHECKING:
    from mmspec_ray.targets.base import VLMTarget

__all__ = ["check_released", "load_released", "recognise"]


def check_released(path: str | Path, facts: TargetFacts | None = None) -> ReleasedDrafter:
    """A released head recognised, checked against `facts` where given, and built on the meta device from its
    weight names and shapes (no weights loaded); this project's own drafters are recognised only."""
    r = recognise(path)
    if r.layout == "mmspec":
        return r
    if facts is not None:
        check_target(r, facts)
    build_head(r, r.state, _vocab(r, facts), meta=True)
    return r


def load_released(r: ReleasedDrafter, target: "VLMTarget"):
    """The drafter of `r`'s method with the released weights, checked against `target` first."""
    facts = facts_of(target)
    check_target(r, facts)
    meta = not r.state or any(v.is_meta for v in r.state.values())
    state = read_state(r.path, r.weights) if meta else r.state
    head, cls = build_head(r, state, _vocab(r, facts), meta=False)
    return cls(head, target)


def _vocab(r: ReleasedDrafter, facts: TargetFacts | None) -> int:
    """The target vocabulary the head assumes: its config's, else the target's, else its t2d's or embeddings' rows
    (without a target), else its LM head's."""
    s = r.shapes
    for n in (r.config.get("vocab_size"), facts and facts.vocab_size, (s.get("t2d") or (None,))[0],
              (s.get("embed_tokens.weight") or (None,))[0], (s.get("lm_head.weight") or (None,))[0]):
        if n:
            return int(n)
    return 0


def build_head(r: ReleasedDrafter, state: dict[str, torch.Tensor], vocab: int, meta: bool):
    """(the head of `r`'s method holding `state`'s weights, its drafter class); `meta`: built on the meta device,
    every check made, nothing loaded."""
    from mmspec_ray.drafters.base import drafter_class

    cls = drafter_class(r.method)
    cfg = (eagle3_config(r, vocab) if r.method == "eagle3" else dream_config(r, vocab) if r.method == "dream"
           else lineage_config(r, cls, vocab, state))
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            head = cls.head_class(cfg)
    except ValueError as e:  # e.g. an mrope_section that does not fit the head's rotary frequencies
        raise DrafterError(f"drafter {r.path} ({r.layout}): config.json does not describe a head this loader can "
                           f"build ({first_line(e)}): restore the config the head was published with") from None
    m = Taken(state)
    if r.method == "eagle3":
        map_eagle3(r, head, m, state)
    elif r.method == "dream":
        map_dream(m)
    else:
        map_lineage(r, m, state)
    _load_exactly(head, m, r, load=not meta)
    return head, cls


def eagle3_config(r: ReleasedDrafter, vocab: int):
    from mmspec_ray.drafters.eagle3 import Eagle3Config

    c = r.config
    heads, kv = _heads(c)
    rope = rope_of(r.path, c)
    return Eagle3Config(hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=kv,
                        intermediate_size=int(c["intermediate_size"]), rope_theta=rope_base(r),
                        rms_eps=float(c.get("rms_norm_eps", 1e-6)), qkv_bias=bool(c.get("attention_bias", False)),
                        target_model_type=str(c.get("target_model_type", "")), target_vocab_size=vocab,
                        draft_vocab_size=int(c.get("draft_vocab_size") or vocab),
                        feature_layers=aux_layers(r), head_dim=c.get("head_dim"), layout=r.layout,
                        norm_before_residual=bool(c.get("norm_before_residual", False)), media_embeds="token",
                        mrope_section=rope.section, mrope_interleaved=rope.interleaved)


EAGLE3_KEYS = {  # released name -> Eagle3Head name
    "fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
    "midlayer.input_layernorm.weight": "embed_norm.weight", "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight": "layer.post_norm.weight",
}
LAYER_KEYS = [f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")] + \
    [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def _layer_name(key: str) -> str:
    """`self_attn.q_proj.weight` / `mlp.gate_proj.weight` -> our DecoderLayer's `q_proj.weight` / `gate_proj.weight`."""
    return key.split(".", 1)[1]


def map_eagle3(r: ReleasedDrafter, head: torch.nn.Module, m: "Taken", state: dict[str, torch.Tensor]) -> None:
    """EAGLE-3's keys onto Eagle3Head's; d2t checked (strictly increasing target ids inside the vocabulary) and t2d
    checked against it."""
    cfg = head.cfg
    for src, ours in EAGLE3_KEYS.items():
        m.take(ours, src)
    for k in LAYER_KEYS:
        m.take(f"layer.{_layer_name(k)}", f"midlayer.{k}")
    if cfg.draft_vocab_size == cfg.target_vocab_size and "d2t" not in state:
        m.put("d2t", head.d2t)  # no reduced vocabulary: the identity (SafeAILab deletes the buffers, vLLM
        m.put("t2d", head.t2d)  # zero-initialises d2t)
        return
    where = f"drafter {r.path} ({r.layout})"
    if "d2t" not in state:
        raise DrafterError(f"{where}: draft vocabulary {cfg.draft_vocab_size} < the target's {cfg.target_vocab_size} "
                           "but no d2t map is saved: copy the head's d2t tensor into its weight file")
    d2t = state["d2t"].long()
    if tuple(d2t.shape) != (cfg.draft_vocab_size,):
        raise DrafterError(f"{where}: d2t has shape {list(d2t.shape)}, not the draft vocabulary's "
                           f"[{cfg.draft_vocab_size}]: restore the d2t saved with this head")
    m.put("d2t", d2t, "d2t")
    ids = torch.arange(cfg.draft_vocab_size) + d2t
    if not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < cfg.target_vocab_size):
        raise DrafterError(f"{where}: d2t maps draft ids to target ids that are not strictly increasing within the "
                           f"vocabulary of {cfg.target_vocab_size}: restore the d2t saved with this head")
    t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    if "t2d" in state and tuple(state["t2d"].shape) != (cfg.target_vocab_size,):
        raise DrafterError(f"{where}: t2d has {state['t2d'].shape[0]} entries, but the target vocabulary is "
                           f"{cfg.target_vocab_size} (config.json vocab_size, else the target's): use a head made "
                           "for this vocabulary, or restore the config it was published with")
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise DrafterError(f"{where}: t2d does not mark exactly the target ids d2t maps to: restore the d2t and "
                           "t2d saved with this head")
    m.put("t2d", t2d)


DREAM_KEYS = {  # the authors' DREAM keys -> DreamHead's (layers.0 / 2: self-attention blocks, layers.1: cross)
    "layers.1.input_layernorm.weight": "cross.input_norm.weight", "layers.1.cross_attn.q_norm.weight":
    "cross.q_norm.weight", "layers.1.cross_attn.k_norm.weight": "cross.k_norm.weight",
    "layers.1.cross_attn_attn_gate": "cross.attn_gate", "layers.1.cross_attn_mlp_gate": "cross.mlp_gate",
    "layers.1.post_attention_layernorm.weight": "cross.post_norm.weight", "norm.weight": "norm.weight",
    "layers.0.post_attention_layernorm.weight": "block1.post_norm.weight",
    "layers.2.input_layernorm.weight": "block3.input_norm.weight",
    "layers.2.post_attention_layernorm.weight": "block3.post_norm.weight",
}


def dream_config(r: ReleasedDrafter, vocab: int):
    """A DREAM head as the authors save it, as a DreamConfig (null memory slot off: they trained without one)."""
    from mmspec_ray.drafters.dream import DreamConfig

    c = r.config
    heads, kv = _heads(c)
    return DreamConfig(hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=kv,
                       intermediate_size=int(c["intermediate_size"]), rope_theta=rope_base(r),
                       rms_eps=float(c.get("rms_norm_eps", 1e-6)), target_vocab_size=vocab, null_slot=False)


def map_dream(m: "Taken") -> None:
    for src, ours in DREAM_KEYS.items():
        m.take(ours, src)
    for layer, ours in (("layers.0", "block1"), ("layers.2", "block3")):
        for k in LAYER_KEYS:
            m.take(f"{ours}.{_layer_name(k)}", f"{layer}.{k}")
    for p in "qkvo":
        m.take(f"cross.{p}_proj.weight", f"layers.1.cross_attn.{p}_proj.weight")
    for p in ("gate", "up", "down"):
        m.take(f"cross.{p}_proj.weight", f"layers.1.mlp.{p}_proj.weight")


def lineage_config(r: ReleasedDrafter, cls: type, vocab: int, state: dict[str, torch.Tensor]):
    """EAGLE-1/2, MSD, ViSpec and HiViS heads (SafeAILab's `cnets1.py` lineage) as their head class's config."""
    c = r.config
    heads, kv = _heads(c)
    extra: dict[str, Any] = {}
    if r.method in ("msd", "vispec"):
        extra["media_norm"] = False  # the authors feed the projector's output as it is
    if r.method == "vispec":
        extra.update(compressed=int(state["imadpt.q"].shape[0]) - 1, adaptor_bias="imadpt.k_proj.bias" in state)
    if r.method == "hivis":
        steps = state.get("residual", state.get("adaptive_embedding"))
        qwen = "qwen" in str(c.get("model_type", "")).lower() or any("Qwen" in a for a in c.get("architectures") or [])
        extra.update(seq_steps=int(steps.shape[0]), drop_vision_markers=qwen, original_positions=qwen)
    return cls.head_class.config_class(
        hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=kv,
        intermediate_size=int(c["intermediate_size"]), rope_theta=rope_base(r),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(c.get("qkv_bias")) or "layers.0.self_attn.q_proj.bias" in state,
        input_norm="layers.0.input_layernorm.weight" in state, target_vocab_size=vocab, **extra)


def map_lineage(r: ReleasedDrafter, m: "Taken", state: dict[str, torch.Tensor]) -> None:
    """`fc`, `layers.0.*` (and ViSpec's adaptor, HiViS's step embeddings) onto the head; the LM head is the target's."""
    d = int(r.config["hidden_size"])
    fc = state["fc.weight"]
    m.put("fc.weight", fc[:, :2 * d], "fc.weight")
    m.put("fc.bias", state.get("fc.bias", torch.zeros(d, dtype=fc.dtype)), "fc.bias")
    m.take("layer.post_norm.weight", "layers.0.post_attention_layernorm.weight")
    m.take("layer.input_norm.weight", "layers.0.input_layernorm.weight")
    for k in LAYER_KEYS:
        m.take(f"layer.{_layer_name(k)}", f"layers.0.{k}")
    if r.method == "vispec":
        for k in ("img_fc.weight", "img_fc.bias"):
            m.take(k, k)
        m.take("adaptor.queries", "imadpt.q")
        for k in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "o_proj.weight"):
            m.take(f"adaptor.{k}", f"imadpt.{k}")
    if r.method == "hivis":  # fc([e; h; residual[i]]) = fc_2d([e; h]) + W_3 residual[i]: our step embeddings
        key = "residual" if "residual" in state else "adaptive_embedding"
        steps = state[key]
        m.put("seq_embed", steps.float() @ fc[:, 2 * d:].float().T, key)
        m.put("seq_rows", torch.tensor(steps.shape[0]))


def _heads(c: dict[str, Any]) -> tuple[int, int]:
    heads = int(c["num_attention_heads"])
    return heads, int(c.get("num_key_value_heads") or heads)


IGNORED = {"embed_tokens.weight", "t2d"}  # the target's embeddings (shape-checked); t2d (checked against d2t)


class Taken:
    """Our head's tensors gathered from a released state dict, each with the file's keys it came from."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.mapped: dict[str, torch.Tensor] = {}
        self.sources: dict[str, tuple[str, ...]] = {}

    def take(self, ours: str, src: str) -> None:
        """Our `ours` is the file's `src`, where the file has it."""
        if src in self.state:
            self.put(ours, self.state[src], src)

    def put(self, ours: str, value: torch.Tensor, *sources: str) -> None:
        """Our `ours` is `value`, derived from the file's `sources` (none: a default)."""
        self.mapped[ours], self.sources[ours] = value, sources


def _load_exactly(head: torch.nn.Module, m: Taken, r: ReleasedDrafter, load: bool = True) -> None:
    """Load every parameter of `head` from `m` (`load` False: check only), refusing, by name, a missing key, a
    shape that differs, or a weight of the file that nothing reads (a variant this loader does not implement: its
    output would be lost)."""
    own = head.state_dict()
    mapped = m.mapped
    used = {s for k in own if k in m.sources for s in m.sources[k]}
    where = f"drafter {r.path} ({r.layout}): {r.weights}"
    unused = sorted(set(m.state) - used - IGNORED)
    if unused:
        raise DrafterError(f"{where}: weights {unused} belong to a variant this loader does not implement")
    missing = sorted(set(own) - set(mapped))
    if missing:
        raise DrafterError(f"{where}: weights missing for {missing}: the file is incomplete or of another layout")
    bad = [f"{k} {list(mapped[k].shape)} vs {list(v.shape)}" for k, v in own.items() if mapped[k].shape != v.shape]
    if bad:
        raise DrafterError(f"{where}: shapes differ from its config.json: " + "; ".join(bad))
    if load:
        head.load_state_dict({k: mapped[k].to(own[k].dtype) for k in own})
