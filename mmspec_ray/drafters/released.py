"""Drafter checkpoints as their authors publish them, recognised with no conversion step (released_load.py loads them).

A directory whose config.json names no `method` (this project's own drafters do) is recognised by its files, config
fields and weight names, and its `architectures` must be a class that layout is published with. What needs no target
is checked here (config fields, RoPE, EAGLE-3.1 options, the draft vocabulary); `check_target` then refuses, by
name, a head made for another target: hidden size, vocabulary, embeddings, feature layers, family, M-RoPE.
Recognised layouts:

- `eagle3-safeailab`: EAGLE-3 heads as SafeAILab/EAGLE trains them (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
  `t2d`; `pytorch_model.bin` or `model.safetensors`; no embeddings: the target's are used; `architectures`
  `LlamaForCausalLM` or none). Trained with RoPE base 10000 whatever the config says, so that base is used.
- `eagle3-specforge`: the same keys, `architectures: ["LlamaForCausalLMEagle3"]`; RoPE as the config says;
  `eagle_config.eagle_aux_hidden_state_layer_ids` are layer *outputs* (hs[k + 1]) where given.
- `eagle3-vllm`: the same keys, `architectures: ["Eagle3LlamaForCausalLM"]` (vLLM's and speculators' spelling); RoPE
  as the config says. EAGLE-3 heads whose RoPE has an `mrope_section` (SpecForge's Qwen2.5-VL heads) rotate by the
  target's 3-axis M-RoPE position ids, as SpecForge trains them and SGLang runs them.
- `eagle-safeailab`: EAGLE-1 / EAGLE-2 heads (`fc` 2d -> d, `layers.0.*` without an input norm, usually a copy of the
  target's `embed_tokens`, which is checked and not used; no LM head: the target's is used).
- `msd-authors`: MSD heads (Lyn-Lucy/MSD): EAGLE-1's keys, a config whose `model_type` is `llava` or `qwen2_vl` (the
  target family it was trained for; Qwen2-VL heads: an input norm and q/k/v biases); media entries take the raw
  projected embeddings (no normalisation).
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmspec_ray.drafters.files import DrafterError, TargetMismatch, read_config, read_meta, weight_file

if TYPE_CHECKING:
    from mmspec_ray.drafters.facts import TargetFacts

LAYOUTS = ("mmspec", "eagle3-safeailab", "eagle3-specforge", "eagle3-vllm", "eagle-safeailab", "msd-authors",
           "vispec-authors", "hivis-authors", "dream-authors")
# the `architectures` EAGLE-3 weights (midlayer.*) are published under, and the layout each one means
EAGLE3_ARCHS = {"LlamaForCausalLM": "eagle3-safeailab", "LlamaForCausalLMEagle3": "eagle3-specforge",
                "Eagle3LlamaForCausalLM": "eagle3-vllm"}
# EAGLE-1/2 and the vision drafters built on it copy their base model's config (SafeAILab's, vLLM's and SGLang's
# EAGLE-1 names, MSD's LLaVA-1.5 template); a VLM class there (`...ForConditionalGeneration`) names the target
LINEAGE_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                 "EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlavaLlamaForCausalLM")
VLM_CLASS = "ForConditionalGeneration"
REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size")
ROPE_KINDS = (None, "default", "mrope")  # RoPE types these heads run as written


@dataclass(frozen=True)
class Rope:
    """A head's RoPE as its config gives it: `rope_theta` / `rope_scaling`, or transformers 5's `rope_parameters`."""

    theta: float | None  # None: the config names no base
    kind: str | None  # rope_type (or the older `type`)
    section: list[int]  # M-RoPE frequencies per axis; [] for 1-D positions
    interleaved: bool  # Qwen3-VL's layout of the sections


@dataclass
class ReleasedDrafter:
    """What a checkpoint directory holds, read from its config and weight names (weights loaded on demand)."""

    path: Path
    layout: str
    method: str
    config: dict[str, Any]
    weights: str  # the weight file's name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # meta tensors, d2t / t2d values

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
                out["feature_layers"] = c.get("feature_layers") or "default (2, L//2, L-3)"
                out["media_embeds"] = c.get("media_embeds", "merged")
                section = c.get("mrope_section")
                out["positions"] = f"M-RoPE, sections {section}" if section else "1-D"
            out["rope_theta"] = c.get("rope_theta")
            return out
        rope = rope_of(self.path, c)
        if c.get("target_model_type"):
            out["target_model_type"] = c["target_model_type"]
        if self.method == "eagle3":
            out["draft_vocab_size"] = c.get("draft_vocab_size") or out["vocab_size"]
            out["feature_layers"] = aux_layers(self) or "default (2, L//2, L-3)"
            out["media_embeds"] = "token"
            out["positions"] = f"M-RoPE, sections {rope.section}" if rope.section else "1-D"
        out["rope_theta"] = rope_base(self)
        if self.layout == "eagle3-safeailab" and rope.theta not in (None, 10000.0):
            out["note"] = (f"config rope_theta {rope.theta} is not used: SafeAILab trains EAGLE-3 heads at base "
                           "10000 whatever the config says")
        return out


def recognise(path: str | Path) -> ReleasedDrafter:
    """The layout of a drafter directory, checked as far as it can be without a target, or a DrafterError naming
    the file or field at fault."""
    path = Path(path)
    config = read_config(path)
    name = weight_file(path)
    if name is None:
        raise DrafterError(f"drafter {path} has no weights (model.safetensors or pytorch_model.bin): copy the weight "
                           "file next to its config.json")
    if config.get("method"):
        return ReleasedDrafter(path, "mmspec", str(config["method"]), config, name)
    state = read_meta(path, name)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    archs = _architectures(path, config)

    def made(layout: str, method: str) -> ReleasedDrafter:
        return _checked(ReleasedDrafter(path, layout, method, config, name, shapes, state))

    if "midlayer.self_attn.q_proj.weight" in shapes and "fc.weight" in shapes:
        unknown = [a for a in archs if a not in EAGLE3_ARCHS]
        if unknown or len(set(archs)) > 1:
            raise DrafterError(f"drafter {path}: architectures {archs} with EAGLE-3 weights (midlayer.*): accepted "
                               f"are {', '.join(EAGLE3_ARCHS)} (SafeAILab, SpecForge, vLLM); set config.json's "
                               "architectures to the one of the runtime that trained the head")
        layout = EAGLE3_ARCHS[archs[0]] if archs else "eagle3-safeailab"
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids and layout == "eagle3-vllm":
            raise DrafterError(f"drafter {path}: architectures {archs} with eagle_aux_hidden_state_layer_ids {ids}: "
                               "whether the ids are layer inputs or outputs depends on the producer (SpecForge's "
                               "LlamaForCausalLMEagle3: outputs); refused as ambiguous: name the producer's "
                               "architecture in config.json")
        return made(layout, "eagle3")
    if "layers.1.cross_attn.q_proj.weight" in shapes and "norm.weight" in shapes:
        _lineage(path, archs, "dream-authors")
        return made("dream-authors", "dream")
    if "layers.0.self_attn.q_proj.weight" in shapes and "fc.weight" in shapes:
        d = config.get("hidden_size")
        steps = "residual" in shapes or "adaptive_embedding" in shapes
        layout, method = None, None
        if "imadpt.q" in shapes and "img_fc.weight" in shapes:
            layout, method = "vispec-authors", "vispec"
        elif steps and shapes["fc.weight"] == (d, 3 * d):
            layout, method = "hivis-authors", "hivis"
        elif shapes["fc.weight"] == (d, 2 * d) and not steps:
            msd = config.get("model_type") in ("llava", "qwen2_vl")
            layout, method = ("msd-authors", "msd") if msd else ("eagle-safeailab", "eagle2")
        if layout is not None:
            _lineage(path, archs, layout)
            return made(layout, method)
    keys = sorted(shapes)[:8]
    raise DrafterError(f"drafter {path}: unknown checkpoint layout (architectures {archs}, weight names {keys} ...); "
                       f"layouts known: {', '.join(LAYOUTS)}")


def _architectures(path: Path, config: dict[str, Any]) -> list[str]:
    """config.json's `architectures`: a list of class names ([] when absent: the authors' loaders ignore it)."""
    archs = config.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise DrafterError(f"drafter {path}: config.json architectures {archs!r} is not a list of class names: "
                           "write it as a list, e.g. [\"LlamaForCausalLMEagle3\"]")
    return archs


def _lineage(path: Path, archs: list[str], layout: str) -> None:
    """EAGLE-1/2-lineage weights under an EAGLE-3 name, or under a class no such head is published with: refused."""
    if any(a in EAGLE3_ARCHS and a != "LlamaForCausalLM" for a in archs):
        raise DrafterError(f"drafter {path}: architectures {archs} names an EAGLE-3 head, but its weights are "
                           f"{layout}'s (layers.0.*, no midlayer.*): fix config.json's architectures or the weights")
    bad = [a for a in archs if a not in LINEAGE_ARCHS and not a.endswith(VLM_CLASS)]
    if bad:
        raise DrafterError(f"drafter {path} ({layout}): architectures {bad} is not a class this layout is published "
                           f"with; accepted: {', '.join(LINEAGE_ARCHS)} or the target's own *{VLM_CLASS} class: "
                           "set config.json's architectures to the base model's class")


def _checked(r: ReleasedDrafter) -> ReleasedDrafter:
    """Refuse, by name, a config this loader cannot honour: a missing size field, more than one decoder layer
    (DREAM's three are fixed by its code, whatever its config says), a RoPE it does not apply, EAGLE-3.1 options,
    a draft vocabulary that disagrees with the LM head's rows."""
    c, where = r.config, f"drafter {r.path} ({r.layout})"
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise DrafterError(f"{where}: config.json lacks {missing}: add them from the head's training config")
    if r.method != "dream" and int(c.get("num_hidden_layers", 1)) != 1:
        raise DrafterError(f"{where}: num_hidden_layers {c['num_hidden_layers']}; only one-layer heads are supported")
    rope = rope_of(r.path, c)
    if rope.kind not in ROPE_KINDS:
        raise DrafterError(f"{where}: rope_scaling / rope_parameters type {rope.kind!r} is not supported (only none, "
                           "default, mrope)")
    if r.method != "eagle3":
        return r
    if c.get("fc_norm") or c.get("norm_output") is False or any(k.startswith("fc_norm.") for k in r.shapes):
        raise DrafterError(f"{where}: EAGLE-3.1 options (fc_norm, norm_output false) are not supported")
    rows = (r.shapes.get("lm_head.weight") or (None,))[0]
    vocab, draft = c.get("vocab_size"), c.get("draft_vocab_size")
    if rows is not None and draft is None and vocab is not None and rows != vocab:
        raise DrafterError(f"{where}: config.json has no draft_vocab_size, but lm_head.weight has {rows} rows "
                           f"(vocab_size {vocab}): add \"draft_vocab_size\": {rows} to config.json")
    if rows is not None and draft is not None and rows != draft:
        raise DrafterError(f"{where}: config.json draft_vocab_size {draft}, but lm_head.weight has {rows} rows: "
                           "set draft_vocab_size to the head's, or restore the weights it was published with")
    return r


def rope_of(path: Path, c: dict[str, Any]) -> Rope:
    """The head's RoPE from `rope_parameters` (transformers 5) and `rope_theta` / `rope_scaling` (older configs);
    refused where the two name different bases."""
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise DrafterError(f"drafter {path}: rope_parameters {params} is not one RoPE setting (per-layer-type RoPE is "
                           "not supported for a one-layer head)")
    both = {**(c.get("rope_scaling") or {}), **params}
    old, new = c.get("rope_theta"), params.get("rope_theta")
    if old is not None and new is not None and float(old) != float(new):
        raise DrafterError(f"drafter {path}: config.json rope_theta {old} and rope_parameters.rope_theta {new} "
                           "disagree: keep the one the head was trained with")
    theta = new if new is not None else old
    section = [int(n) for n in both.get("mrope_section") or []]
    return Rope(None if theta is None else float(theta), both.get("rope_type", both.get("type")), section,
                bool(section) and bool(both.get("mrope_interleaved", False)))


def rope_base(r: ReleasedDrafter) -> float:
    """The RoPE base a released head runs at: 10000 for SafeAILab's EAGLE-3 (its training ignores the config),
    else its config's (10000 where it names none)."""
    theta = rope_of(r.path, r.config).theta
    return 10000.0 if r.layout == "eagle3-safeailab" or theta is None else theta


def aux_layers(r: ReleasedDrafter) -> list[int]:
    """The hs indices a released EAGLE-3 head reads, where its config names them ([] = the default rule).
    SpecForge's `eagle_aux_hidden_state_layer_ids` are layer outputs: output of layer k = hs[k + 1]."""
    ids = (r.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return []
    return [int(k) + 1 for k in ids] if r.layout == "eagle3-specforge" else [int(k) for k in ids]


def multimodal(model_type: str) -> bool:
    """Whether `model_type` names a vision-language family (its transformers config has a vision part), so a head's
    `model_type` of that name says which target it was trained for (a language model's, e.g. llama, does not)."""
    from transformers import CONFIG_MAPPING

    try:
        return "vision_config" in (getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {})
    except KeyError:
        return False


def check_target(r: ReleasedDrafter, facts: "TargetFacts") -> None:
    """Refuse, naming the mismatch, a released head built for another target: sizes, embeddings, feature layers,
    family (`target_model_type`, or a multimodal `model_type`), model class, M-RoPE positions."""
    from mmspec_ray.drafters.eagle3 import default_feature_layers

    c = r.config
    d, vocab = c.get("hidden_size"), c.get("vocab_size")
    t_hidden = c.get("target_hidden_size", d)
    problems = []
    if d != facts.hidden_size or t_hidden != facts.hidden_size:
        problems.append(f"hidden size {d} (target features {t_hidden}) vs the target's {facts.hidden_size}")
    if vocab is not None and vocab != facts.vocab_size:
        problems.append(f"vocabulary {vocab} vs the target's {facts.vocab_size}")
    emb = r.shapes.get("embed_tokens.weight")
    if emb is not None and emb != (facts.vocab_size, facts.hidden_size):
        problems.append(f"embed_tokens {list(emb)} vs the target's [{facts.vocab_size}, {facts.hidden_size}]")
    family = c.get("target_model_type") or (c.get("model_type") if multimodal(str(c.get("model_type"))) else None)
    if family and family not in facts.model_types:
        key = "target_model_type" if c.get("target_model_type") else "model_type"
        problems.append(f"{key} {family} vs the target's {facts.model_type}")
    vlm = [a for a in c.get("architectures") or [] if a.endswith(VLM_CLASS) and a not in facts.architectures]
    if vlm and facts.architectures:
        problems.append(f"architectures {vlm} vs the target's {list(facts.architectures)}")
    if r.method == "eagle3":
        section = rope_of(r.path, c).section
        if section and not facts.mrope_section:
            problems.append(f"M-RoPE positions (mrope_section {section}) vs the target's 1-D RoPE")
        layers = aux_layers(r) or default_feature_layers(facts.num_layers)
        if any(not 0 <= k < facts.num_layers for k in layers):
            problems.append(f"it reads target layers {layers} (hidden_states indices: the input of each decoder "
                            f"layer) but the target has {facts.num_layers} decoder layers")
    if problems:
        raise TargetMismatch(f"drafter {r.path} ({r.layout}) was built for another target: " + "; ".join(problems) +
                             f"; use a head made for {facts.model_type} {facts.name}, or train one with "
                             "`mmspec train-drafter`")
