"""Drafter checkpoints as their authors publish them, loaded with no conversion step.

A directory whose config.json names no `method` (this project's own drafters do) is recognised by its files, config
fields and weight names, mapped onto the drafter of that method, and checked against the target: hidden size,
vocabulary and feature layers, each refused by name. Recognised layouts:

- `eagle3-safeailab`: EAGLE-3 heads as SafeAILab/EAGLE trains them (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
  `t2d`; `pytorch_model.bin` or `model.safetensors`; no embeddings: the target's are used). Trained with RoPE base
  10000 whatever the config says, so that base is used.
- `eagle3-specforge`: the same keys, `architectures: ["LlamaForCausalLMEagle3"]`; `rope_theta` as the config says;
  `eagle_config.eagle_aux_hidden_state_layer_ids` are layer *outputs* (hs[k + 1]) where given.
  EAGLE-3 heads whose `rope_scaling` has an `mrope_section` (SpecForge's Qwen2.5-VL heads) rotate by the target's
  3-axis M-RoPE position ids, as SpecForge trains them and SGLang runs them.
- `eagle-safeailab`: EAGLE-1 / EAGLE-2 heads (`fc` 2d -> d, `layers.0.*` without an input norm, usually a copy of the
  target's `embed_tokens`, which is checked and not used; no LM head: the target's is used).
- `msd-authors`: MSD heads (Lyn-Lucy/MSD): EAGLE-1's keys, a config whose `model_type` is `llava` or `qwen2_vl`
  (Qwen2-VL heads: an input norm and q/k/v biases); media entries take the raw projected embeddings (no
  normalisation).
- `vispec-authors`: ViSpec heads (KangJialiang/ViSpec): EAGLE-1's keys plus `img_fc` and the vision adaptor
  `imadpt.*` (num_q = n_c + 1 queries, read from `imadpt.q`); media rows enter the adaptor as they are.
- `dream-authors`: DREAM heads (SAI-Lab-NYU/DREAM): three layers (`layers.1` the cross-attention block with
  `cross_attn.{q,k}_norm` and tanh gates), `norm`; no fc, no embeddings, no LM head (the target's); trained without
  our zero memory slot, so it is read only where a query sees no target feature.
- `hivis-authors`: HiViS heads: `fc` 3d -> d over [embedding; feature; residual[step]] and the step embeddings
  `residual` [R, d] (older files: `adaptive_embedding`); on Qwen2.5-VL the authors' rule of dropping the vision
  markers with the media and of keeping the text tokens' original positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mmspec_ray.targets.base import VLMTarget

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYOUTS = ("mmspec", "eagle3-safeailab", "eagle3-specforge", "eagle-safeailab", "msd-authors", "vispec-authors",
           "hivis-authors", "dream-authors")


@dataclass
class ReleasedDrafter:
    """What a checkpoint directory holds, read from its config and weight names (weights loaded on demand)."""

    path: Path
    layout: str
    method: str
    config: dict[str, Any]
    weights: str  # the weight file's name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The dimensions a target must have for this drafter."""
        c = self.config
        out: dict[str, Any] = {"layout": self.layout, "method": self.method, "weights": self.weights,
                               "hidden_size": c.get("hidden_size"),
                               "vocab_size": c.get("vocab_size", c.get("target_vocab_size"))}
        if self.layout == "mmspec":
            out["vocab_size"] = c.get("target_vocab_size")
        if self.method == "eagle3":
            out["draft_vocab_size"] = c.get("draft_vocab_size") or out["vocab_size"]
            layers = c.get("feature_layers") if self.layout == "mmspec" else aux_layers(self)
            out["feature_layers"] = layers or "default (2, L//2, L-3)"
            out["media_embeds"] = c.get("media_embeds", "merged") if self.layout == "mmspec" else "token"
            section = c.get("mrope_section") if self.layout == "mmspec" else mrope_of(c)[0]
            out["positions"] = f"M-RoPE, sections {section}" if section else "1-D"
        if self.layout == "eagle3-safeailab":
            out["rope_theta"] = 10000.0
        elif self.layout != "mmspec":
            out["rope_theta"] = float(c.get("rope_theta") or 10000.0)
        else:
            out["rope_theta"] = c.get("rope_theta")
        return out


def weight_file(path: Path) -> str | None:
    return next((f for f in WEIGHT_FILES if (path / f).exists()), None)


def read_state(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The whole state dict of a safetensors or torch .bin weight file (tensors only, never pickled code)."""
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path / name))
    return torch.load(path / name, map_location="cpu", weights_only=True)


def read_shapes(path: Path, name: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape, from a safetensors header alone where possible."""
    if name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path / name), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return {k: tuple(v.shape) for k, v in read_state(path, name).items()}


def recognise(path: str | Path) -> ReleasedDrafter:
    """The layout of a drafter directory, or a ValueError naming what was found and the layouts known."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"drafter {path} has no config.json; layouts known: {', '.join(LAYOUTS)}")
    config = json.loads(cfg_file.read_text())
    name = weight_file(path)
    if name is None:
        raise ValueError(f"drafter {path} has no weights ({' or '.join(WEIGHT_FILES)})")
    if config.get("method"):
        return ReleasedDrafter(path, "mmspec", config["method"], config, name)
    shapes = read_shapes(path, name)
    archs = config.get("architectures") or []
    if "midlayer.self_attn.q_proj.weight" in shapes and "fc.weight" in shapes:
        layout = "eagle3-specforge" if "LlamaForCausalLMEagle3" in archs else "eagle3-safeailab"
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids and layout == "eagle3-safeailab" and any("Eagle3" in a for a in archs):
            raise ValueError(f"drafter {path}: architectures {archs} with eagle_aux_hidden_state_layer_ids {ids}: "
                             "whether the ids are layer inputs or outputs depends on the producer (SpecForge's "
                             "LlamaForCausalLMEagle3: outputs); refused as ambiguous")
        return _checked(ReleasedDrafter(path, layout, "eagle3", config, name, shapes))
    if "layers.1.cross_attn.q_proj.weight" in shapes and "norm.weight" in shapes:
        return _checked(ReleasedDrafter(path, "dream-authors", "dream", config, name, shapes))
    if "layers.0.self_attn.q_proj.weight" in shapes and "fc.weight" in shapes:
        d = config.get("hidden_size")
        steps = "residual" in shapes or "adaptive_embedding" in shapes
        if "imadpt.q" in shapes and "img_fc.weight" in shapes:
            return _checked(ReleasedDrafter(path, "vispec-authors", "vispec", config, name, shapes))
        if steps and shapes["fc.weight"] == (d, 3 * d):
            return _checked(ReleasedDrafter(path, "hivis-authors", "hivis", config, name, shapes))
        if shapes["fc.weight"] == (d, 2 * d) and not steps:
            if config.get("model_type") in ("llava", "qwen2_vl"):
                return _checked(ReleasedDrafter(path, "msd-authors", "msd", config, name, shapes))
            return _checked(ReleasedDrafter(path, "eagle-safeailab", "eagle2", config, name, shapes))
    keys = sorted(shapes)[:8]
    raise ValueError(f"drafter {path}: unknown checkpoint layout (architectures {archs}, weight names {keys} ...); "
                     f"layouts known: {', '.join(LAYOUTS)}")


REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size")
ROPE_KINDS = (None, "default", "mrope")  # rope_scaling types these heads run as written


def _checked(r: ReleasedDrafter) -> ReleasedDrafter:
    """Refuse, by name, a config this loader cannot honour: a missing size field, more than one decoder layer
    (DREAM's three are fixed by its code, whatever its config says), a RoPE scaling it does not apply."""
    c = r.config
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ValueError(f"drafter {r.path} ({r.layout}): config.json lacks {missing}")
    if r.method != "dream" and int(c.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"drafter {r.path} ({r.layout}): num_hidden_layers {c['num_hidden_layers']}; only "
                         "one-layer heads are supported")
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"drafter {r.path} ({r.layout}): rope_scaling {scaling} is not supported")
    return r


def aux_layers(r: ReleasedDrafter) -> list[int]:
    """The hs indices a released EAGLE-3 head reads, where its config names them ([] = the default rule).
    SpecForge's `eagle_aux_hidden_state_layer_ids` are layer outputs: output of layer k = hs[k + 1]."""
    ids = (r.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return []
    return [int(k) + 1 for k in ids] if r.layout == "eagle3-specforge" else [int(k) for k in ids]


def check_target(r: ReleasedDrafter, target: "VLMTarget") -> None:
    """Refuse, naming the mismatch, a released head built for another target."""
    c = r.config
    d, vocab = c.get("hidden_size"), c.get("vocab_size")
    t_hidden = c.get("target_hidden_size", d)
    problems = []
    if d != target.hidden_size or t_hidden != target.hidden_size:
        problems.append(f"hidden size {d} (target features {t_hidden}) vs the target's {target.hidden_size}")
    if vocab is not None and vocab != target.vocab_size:
        problems.append(f"vocabulary {vocab} vs the target's {target.vocab_size}")
    emb = r.shapes.get("embed_tokens.weight")
    if emb is not None and emb != (target.vocab_size, target.hidden_size):
        problems.append(f"embed_tokens {list(emb)} vs the target's [{target.vocab_size}, {target.hidden_size}]")
    if problems:
        raise ValueError(f"drafter {r.path} ({r.layout}) was built for another target: " + "; ".join(problems))


def _heads(c: dict[str, Any]) -> tuple[int, int]:
    heads = int(c["num_attention_heads"])
    return heads, int(c.get("num_key_value_heads") or heads)


def mrope_of(c: dict[str, Any]) -> tuple[list[int], bool]:
    """A released EAGLE-3 config's M-RoPE layout: `rope_scaling.mrope_section` (and `mrope_interleaved`), as SGLang
    reads it to run the head at the target's 3-axis position ids; ([], False) without one."""
    scaling = c.get("rope_scaling") or {}
    section = [int(n) for n in scaling.get("mrope_section") or []]
    return section, bool(section) and bool(scaling.get("mrope_interleaved", False))


def eagle3_config(r: ReleasedDrafter, target: "VLMTarget"):
    from mmspec_ray.drafters.eagle3 import Eagle3Config

    c = r.config
    heads, kv = _heads(c)
    theta = float(c.get("rope_theta") or 10000.0) if r.layout == "eagle3-specforge" else 10000.0
    section, interleaved = mrope_of(c)
    return Eagle3Config(hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=kv,
                        intermediate_size=int(c["intermediate_size"]), rope_theta=theta,
                        rms_eps=float(c.get("rms_norm_eps", 1e-6)), qkv_bias=bool(c.get("attention_bias", False)),
                        target_model_type=str(c.get("target_model_type", "")),
                        target_vocab_size=int(c.get("vocab_size", target.vocab_size)),
                        draft_vocab_size=int(c.get("draft_vocab_size") or c.get("vocab_size", target.vocab_size)),
                        feature_layers=aux_layers(r), head_dim=c.get("head_dim"), layout=r.layout,
                        norm_before_residual=bool(c.get("norm_before_residual", False)), media_embeds="token",
                        mrope_section=section, mrope_interleaved=interleaved)


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


def load_released(r: ReleasedDrafter, target: "VLMTarget"):
    """The drafter of `r`'s method with the released weights, checked against `target` first."""
    check_target(r, target)
    state = read_state(r.path, r.weights)
    if r.method == "eagle3":
        from mmspec_ray.drafters.eagle3 import Eagle3Drafter, Eagle3Head, check_layers

        if r.config.get("fc_norm") or r.config.get("norm_output") is False or any(k.startswith("fc_norm.") for k in state):
            raise ValueError(f"drafter {r.path} ({r.layout}): EAGLE-3.1 options (fc_norm, norm_output false) are not "
                             "supported")
        cfg = eagle3_config(r, target)
        check_layers(cfg, target)
        head = Eagle3Head(cfg)
        m = Taken(state)
        for src, ours in EAGLE3_KEYS.items():
            m.take(ours, src)
        for k in LAYER_KEYS:
            m.take(f"layer.{_layer_name(k)}", f"midlayer.{k}")
        if cfg.draft_vocab_size != cfg.target_vocab_size or "d2t" in state:
            if "d2t" not in state:
                raise ValueError(f"drafter {r.path}: draft vocabulary {cfg.draft_vocab_size} < the target's "
                                 f"{cfg.target_vocab_size} but no d2t map is saved")
            m.put("d2t", state["d2t"].long(), "d2t")
            ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
            if not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < cfg.target_vocab_size):
                raise ValueError(f"drafter {r.path}: d2t maps draft ids to target ids that are not strictly "
                                 f"increasing within the vocabulary of {cfg.target_vocab_size}")
            t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
            t2d[ids] = True
            if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
                raise ValueError(f"drafter {r.path}: t2d does not mark exactly the target ids d2t maps to")
            m.put("t2d", t2d)
        else:  # no reduced vocabulary: the identity (SafeAILab deletes the buffers, vLLM zero-initialises d2t)
            m.put("d2t", head.d2t)
            m.put("t2d", head.t2d)
        _load_exactly(head, m, r)
        return Eagle3Drafter(head, target)
    if r.method == "dream":
        return load_dream(r, target, state)
    return load_eagle_lineage(r, target, state)


DREAM_KEYS = {  # the authors' DREAM keys -> DreamHead's (layers.0 / 2: self-attention blocks, layers.1: cross)
    "layers.1.input_layernorm.weight": "cross.input_norm.weight", "layers.1.cross_attn.q_norm.weight":
    "cross.q_norm.weight", "layers.1.cross_attn.k_norm.weight": "cross.k_norm.weight",
    "layers.1.cross_attn_attn_gate": "cross.attn_gate", "layers.1.cross_attn_mlp_gate": "cross.mlp_gate",
    "layers.1.post_attention_layernorm.weight": "cross.post_norm.weight", "norm.weight": "norm.weight",
    "layers.0.post_attention_layernorm.weight": "block1.post_norm.weight",
    "layers.2.input_layernorm.weight": "block3.input_norm.weight",
    "layers.2.post_attention_layernorm.weight": "block3.post_norm.weight",
}


def load_dream(r: ReleasedDrafter, target: "VLMTarget", state: dict[str, torch.Tensor]):
    """A DREAM head as the authors save it, onto DreamHead (null memory slot off: they trained without one)."""
    from mmspec_ray.drafters.dream import DreamConfig, DreamDrafter, DreamHead

    c = r.config
    heads, kv = _heads(c)
    cfg = DreamConfig(hidden_size=int(c["hidden_size"]), num_heads=heads, num_kv_heads=kv,
                      intermediate_size=int(c["intermediate_size"]), rope_theta=float(c.get("rope_theta") or 10000.0),
                      rms_eps=float(c.get("rms_norm_eps", 1e-6)), target_vocab_size=int(c.get("vocab_size",
                                                                                              target.vocab_size)),
                      null_slot=False)
    head = DreamHead(cfg)
    m = Taken(state)
    for src, ours in DREAM_KEYS.items():
        m.take(ours, src)
    for layer, ours in (("layers.0", "block1"), ("layers.2", "block3")):
        for k in LAYER_KEYS:
            m.take(f"{ours}.{_layer_name(k)}", f"{layer}.{k}")
    for p in "qkvo":
        m.take(f"cross.{p}_proj.weight", f"layers.1.cross_attn.{p}_proj.weight")
    for p in ("gate", "up", "down"):
        m.take(f"cross.{p}_proj.weight", f"layers.1.mlp.{p}_proj.weight")
    _load_exactly(head, m, r)
    return DreamDrafter(head, target)


def load_eagle_lineage(r: ReleasedDrafter, target: "VLMTarget", state: dict[str, torch.Tensor]):
    """EAGLE-1/2, MSD and HiViS heads (SafeAILab's `cnets1.py` lineage): `fc`, `layers.0.*`, the target's LM head."""
    from mmspec_ray.drafters.base import drafter_class

    c = r.config
    heads, kv = _heads(c)
    d = int(c["hidden_size"])
    cls = drafter_class(r.method)
    extra: dict[str, Any] = {}
    if r.method in ("msd", "vispec"):
        extra["media_norm"] = False  # the authors feed the projector's output as it is
    if r.method == "vispec":
        extra.update(compressed=int(state["imadpt.q"].shape[0]) - 1, adaptor_bias="imadpt.k_proj.bias" in state)
    steps = state.get("residual", state.get("adaptive_embedding"))
    if r.method == "hivis":
        qwen = "qwen" in str(c.get("model_type", "")).lower() or any("Qwen" in a for a in c.get("architectures") or [])
        extra.update(seq_steps=int(steps.shape[0]), drop_vision_markers=qwen, original_positions=qwen)
    cfg = cls.head_class.config_class(
        hidden_size=d, num_heads=heads, num_kv_heads=kv, intermediate_size=int(c["intermediate_size"]),
        rope_theta=float(c.get("rope_theta") or 10000.0), rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(c.get("qkv_bias")) or "layers.0.self_attn.q_proj.bias" in state,
        input_norm="layers.0.input_layernorm.weight" in state, target_vocab_size=int(c.get("vocab_size",
                                                                                           target.vocab_size)),
        **extra)
    head = cls.head_class(cfg)
    fc = state["fc.weight"]
    m = Taken(state)
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
        m.put("seq_embed", steps.float() @ fc[:, 2 * d:].float().T, key)
        m.put("seq_rows", torch.tensor(steps.shape[0]))
    _load_exactly(head, m, r)
    return cls(head, target)


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


def _load_exactly(head: torch.nn.Module, m: Taken, r: ReleasedDrafter) -> None:
    """Load every parameter of `head` from `m`, refusing, by name, a missing key, a shape that differs, or a
    weight of the file that nothing reads (a variant this loader does not implement: its output would be lost)."""
    own = head.state_dict()
    mapped = m.mapped
    used = {s for k in own if k in m.sources for s in m.sources[k]}
    unused = sorted(set(m.state) - used - IGNORED)
    if unused:
        raise ValueError(f"drafter {r.path} ({r.layout}): weights {unused} belong to a variant this loader does not "
                         "implement")
    missing = sorted(set(own) - set(mapped))
    if missing:
        raise ValueError(f"drafter {r.path} ({r.layout}): weights missing for {missing}")
    bad = [f"{k} {list(mapped[k].shape)} vs {list(v.shape)}" for k, v in own.items() if mapped[k].shape != v.shape]
    if bad:
        raise ValueError(f"drafter {r.path} ({r.layout}): shapes differ from its config: " + "; ".join(bad))
    head.load_state_dict({k: mapped[k].to(own[k].dtype) for k in own})
