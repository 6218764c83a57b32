"""The generic adapter for image-text-to-text checkpoints without an adapter of their own, and its self-check.

`GenericTarget` is `VLMTarget` as it stands: the processor's chat template and stock call, the model's own prefill
(media merged by the model), 1-D tree positions `next_pos + depth` after a prompt of L tokens at positions 0..L-1,
and a causal tree mask over the committed prefix. Those assumptions hold for many VLMs and are silently wrong for
others (M-RoPE families number positions otherwise, some models need inputs at decode time), so the adapter checks
itself when it is built (`wrap_generic`): one short probe request is decoded greedily by HF `generate`, by our AR
engine, by tree verification against each root-to-leaf path run alone, and by the speculative engine with draft
trees that hide HF's answer among random branches. They must agree token for token, or the target is refused with
a `TargetError` that says which check differed, where, and with which token ids.

The registry names this module by path and imports it on first use (it runs the decoding engine, whose drafters
reach back to the registry for checkpoints); the engine is imported inside `self_check`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from mmspec_ray.targets.base import Request, TargetError, VLMTarget

log = logging.getLogger(__name__)

NEW_TOKENS = 16  # answer tokens the probe compares
TREE_NODES = 12  # nodes of the random tree verified against each of its paths
# relative top-2 logit gap under which a different greedy choice is rounding, not a bug (as the engine's tie guard)
FLOAT32_TIE = 1e-5  # float32 near-tie for the probe's comparisons; half precision takes the engine's TIE_MARGIN
LOGIT_RTOL = 1e-3  # float32: tree vs path logits, relative to the largest logit (summation order moves ~1e-6)


class SelfCheckFailed(TargetError):
    """The generic adapter's self-check found a difference (or could not run): the target is refused."""


def is_image_text_to_text(model_type: str | None) -> bool:
    """Whether transformers' AutoModelForImageTextToText has a class for `model_type`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def chat_template_of(processor) -> str | None:
    tokenizer = getattr(processor, "tokenizer", processor)
    return getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)


class GenericTarget(VLMTarget):
    """The shared adapter, unchanged, for a checkpoint whose model type has no adapter of its own (or when asked
    for with `generic=True`). Images if the processor has an image processor; clips are refused (send frames as
    images): the self-check probes text and one image only."""

    family = "generic"
    self_check: SelfCheck | None = None  # what the self-check compared (set by `wrap_generic`)

    @property
    def takes_images(self) -> bool:  # type: ignore[override]
        return getattr(self.processor, "image_processor", None) is not None


@dataclass(frozen=True)
class SelfCheck:
    """What a passed self-check compared."""

    probe: str  # the probe request, in words
    answer: list[int]  # HF generate's greedy answer
    compared: dict[str, int]  # check -> answer tokens compared (all of them unless a near-tie cut the comparison)
    tree_paths: int  # root-to-leaf paths the random tree was checked against
    max_logit_diff: float  # tree verify vs each path alone, max abs logit difference
    seconds: float


def probe_image(width: int = 80, height: int = 64) -> Image.Image:
    """A small deterministic picture: red and green gradients with a blue square."""
    img = np.zeros((height, width, 3), dtype=np.uint8)
    img[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    img[..., 1] = np.linspace(255, 0, height, dtype=np.uint8)[:, None]
    img[height // 4: height * 3 // 4, width // 3: width * 2 // 3, 2] = 255
    return Image.fromarray(img)


def probe_request(target: VLMTarget) -> Request:
    """Text plus one small image if the target takes images, else text only."""
    if target.takes_images:
        return Request(prompt="Describe this image in one sentence.", images=(probe_image(),))
    return Request(prompt="Write one sentence about the sea.")


def describe(request: Request) -> str:
    media = [f"{len(request.images)} image(s) ({', '.join(f'{i.width}x{i.height}' for i in request.images)})"
             ] if request.images else []
    return " + ".join(["text"] + media) + f", greedy, up to {NEW_TOKENS} new tokens"


class BushyOracle:
    """Probe drafter: each cycle a random tree that hides the known answer's next 0..depth tokens among distractor
    siblings (some with a child of their own), so acceptance stops at any depth and commits paths that are not the
    tree's first nodes. `corrupt`: the chance that one of the hidden tokens is changed, so acceptance stops there
    (the engine's tests use it)."""

    name = "self-check"

    def __init__(self, answer: list[int], vocab: int, seed: int = 0, corrupt: float = 0.0) -> None:
        self.answer, self.vocab, self.corrupt = answer, vocab, corrupt
        self.rng = np.random.default_rng(seed)
        self.pos = 0

    def begin(self, target, prefill, root: int) -> None:
        self.pos = 0

    def propose(self, root: int, cfg):
        from mmspec_ray.decoding.tree import DraftTree, depths

        true = self.answer[self.pos + 1:self.pos + 1 + int(self.rng.integers(0, cfg.depth + 1))]
        if true and self.corrupt and self.rng.random() < self.corrupt:
            j = int(self.rng.integers(0, len(true)))
            true = true[:j] + [(true[j] + 1) % self.vocab]
        tokens, parents = [root], [-1]
        at = 0  # the chain node the next true token hangs under
        for t in true:
            for _ in range(int(self.rng.integers(0, 3))):
                d = int(self.rng.integers(0, self.vocab))
                if d == t or any(tokens[i] == d and parents[i] == at for i in range(len(tokens))):
                    continue
                tokens.append(d)
                parents.append(at)
                if self.rng.random() < 0.5:  # a distractor branch one deeper
                    tokens.append(int(self.rng.integers(0, self.vocab)))
                    parents.append(len(tokens) - 2)
            tokens.append(t)
            parents.append(at)
            at = len(tokens) - 1
        par = torch.tensor(parents)
        scores = -torch.tensor(self.rng.random(len(tokens)), dtype=torch.float32)  # sibling order: random
        scores[0] = 0.0
        return DraftTree(torch.tensor(tokens), par, depths(par), scores)

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.pos += len(tokens)


def self_check(target: VLMTarget, request: Request | None = None, seed: int = 0) -> SelfCheck:
    """Decode a probe request every way the engine can and compare with HF `generate`; raise a TargetError naming
    the first difference. Greedy, with the checkpoint's generation config (as HF applies it). A probe that cannot
    even run (the processor or the model raises) is a TargetError too, with the error it met."""
    request = request or probe_request(target)
    try:
        return _run_probe(target, request, seed)
    except SelfCheckFailed:
        raise
    except Exception as e:  # the processor, HF generate or a forward failed on the probe
        raise _refusal(target, describe(request), f"the probe could not run: {type(e).__name__}: {e}") from e


def _run_probe(target: VLMTarget, request: Request, seed: int) -> SelfCheck:
    from mmspec_ray.config import SamplingParams
    from mmspec_ray.decoding.engine import AREngine, SpecEngine
    from mmspec_ray.decoding.processors import UnsupportedGenerationConfig
    from mmspec_ray.decoding.tree import TreeConfig
    from mmspec_ray.drafters.oracle import OracleDrafter

    t0 = time.perf_counter()
    probe = describe(request)
    greedy = SamplingParams(temperature=0.0)
    try:  # the checkpoint's generation config must be one the engine reproduces (no beam search ...)
        ar = AREngine(target)
    except UnsupportedGenerationConfig as e:
        raise _refusal(target, probe, f"the probe cannot decode with this checkpoint's generation config: {e}") from e
    inputs = target.encode(request)
    n_prompt = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, output_scores=True,
                                   return_dict_in_generate=True)
    answer = hf.sequences[0, n_prompt:].tolist()
    scores = [s[0].float() for s in hf.scores]  # [V] per step: what HF took its argmax over
    compared: dict[str, int] = {}

    def agree(name: str, engine: SpecEngine) -> None:
        ours = engine.generate(request, greedy, max_new_tokens=NEW_TOKENS).token_ids
        i = next((k for k, (a, b) in enumerate(zip(answer, ours)) if a != b), None)
        if i is None and len(ours) == len(answer):
            compared[name] = len(answer)
            return
        if i is not None and _near_tie(scores[i], answer[i], ours[i], target.dtype):
            log.warning("generic self-check: %s and HF generate part at answer token %d on a near-tie (%d vs %d, "
                        "within %s rounding); compared the %d tokens before it", name, i, answer[i], ours[i],
                        target.dtype, i)
            compared[name] = i
            return
        raise _refusal(target, probe, f"{name} differs from HF generate {_difference(target, answer, ours, i)}")

    agree("AR decoding (one token per forward)", ar)
    paths, worst = _tree_vs_paths(target, inputs, probe, np.random.default_rng(seed))
    agree("tree decoding (speculative, random draft trees that hide HF's answer among distractors)",
          SpecEngine(target, BushyOracle(answer, target.vocab_size, seed), TreeConfig(top_k=4, depth=4,
                                                                                         total_tokens=24)))
    agree("chain decoding (speculative, HF's answer drafted as a chain)",
          SpecEngine(target, OracleDrafter(answer), TreeConfig(top_k=1, depth=4, total_tokens=6)))
    report = SelfCheck(probe, answer, compared, paths, worst, time.perf_counter() - t0)
    log.info("generic adapter for %s: self-check passed in %.1f s (%s; %s)", target.config.model_type,
             report.seconds, probe, ", ".join(f"{k}: {v} tokens" for k, v in compared.items()))
    return report


def _tree_vs_paths(target: VLMTarget, inputs: dict, probe: str, rng: np.random.Generator) -> tuple[int, float]:
    """Verify one random tree after the probe prompt, then each of its root-to-leaf paths alone (as a chain): every
    node's greedy choice must agree (and in float32 its logits closely). Returns (paths, max abs logit diff)."""
    from mmspec_ray.decoding.tree import ancestor_mask, depths

    n = TREE_NODES
    parents = torch.tensor([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    tokens = torch.tensor(rng.integers(0, target.vocab_size, size=n))
    depth = depths(parents)
    target.prefill(inputs)
    tree = target.verify(tokens, ancestor_mask(parents), depth).logits[0]
    target.commit([])  # drop the tree: the prefix stays
    kids = set(parents.tolist())
    leaves = [i for i in range(n) if i not in kids]
    worst = 0.0
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        chain = torch.ones((len(path), len(path)), dtype=torch.bool).tril()
        alone = target.verify(tokens[path], chain, torch.arange(len(path))).logits[0]
        target.commit([])
        for j, node in enumerate(path):
            a, b = tree[node], alone[j]
            diff = float((a - b).abs().max())
            worst = max(worst, diff)
            ta, tb = int(a.argmax()), int(b.argmax())
            scale = max(1.0, float(b.abs().max()))
            bad = ta != tb and not _near_tie(b, tb, ta, target.dtype)
            if bad or (target.dtype == torch.float32 and diff > LOGIT_RTOL * scale):
                where = f"node {node} (depth {int(depth[node])}) on the path {path} of a random {n}-node tree"
                how = (f"picks {ta} in the tree and {tb} alone (max logit difference {diff:.3g})" if bad else
                       f"has logits that differ by up to {diff:.3g} in the tree and alone (logit scale {scale:.3g}; "
                       f"float32 allows {LOGIT_RTOL:g} of it)")
                raise _refusal(target, probe, f"tree verification differs from running each path alone: {where} "
                                              f"{how}; the tree's attention mask or positions are not what this "
                                              "model needs")
    return len(leaves), worst


def _near_tie(scores: torch.Tensor, want: int, got: int, dtype: torch.dtype) -> bool:
    """`got` lost to `want` by less than the dtype's rounding (relative to the top score)."""
    from mmspec_ray.decoding.engine import TIE_MARGIN

    gap = float(scores[want] - scores[got])
    return abs(gap) < TIE_MARGIN.get(dtype, FLOAT32_TIE) * max(1.0, abs(float(scores[want])))


def _difference(target: VLMTarget, answer: list[int], ours: list[int], i: int | None) -> str:
    tok = target.tokenizer
    if i is None:  # one is a prefix of the other: one of them stopped early
        i = min(len(answer), len(ours))
        longer = "HF generate" if len(answer) > len(ours) else "ours"
        seq = answer if len(answer) > len(ours) else ours
        head = f"after {i} equal tokens one stopped and {longer} went on with {seq[i]} ({tok.decode([seq[i]])!r})"
    else:
        head = (f"at answer token {i} (the {i} before it agree): HF chose {answer[i]} ({tok.decode([answer[i]])!r}), "
                f"ours {ours[i]} ({tok.decode([ours[i]])!r})")
    return f"{head}; HF {answer}, ours {ours}"


def _refusal(target: VLMTarget, probe: str, what: str) -> SelfCheckFailed:
    from mmspec_ray.targets.registry import families

    mt = target.config.model_type
    named = families()
    fix = (f"model type {mt!r} has its own adapter: load it without generic=True" if mt in named else
           f"if this model is one of the supported families ({', '.join(sorted(named))}), save it under that "
           f"model type; otherwise open an issue asking for a {mt} adapter and include this message")
    return SelfCheckFailed(f"the generic adapter failed its self-check on this {mt} model ({type(target).__name__}), "
                       f"so it would not decode it losslessly: {what}. Probe: {probe}. The generic adapter assumes "
                       "1-D positions that continue the prompt's, a causal mask over the committed tokens and "
                       f"nothing but token ids at decode time; this model needs otherwise. To decode it: {fix}")


def wrap_generic(model, processor, feature_layers: tuple[int, ...] = (),
                 cls: type[GenericTarget] = GenericTarget) -> GenericTarget:
    """`cls` (the generic adapter) around a loaded model, once it has passed its self-check. The model type must be
    an image-text-to-text one and the processor must have a chat template."""
    mt = model.config.model_type
    if not is_image_text_to_text(mt):
        raise TargetError(f"model type {mt!r} has no target adapter, and the generic adapter takes only "
                          "image-text-to-text models (AutoModelForImageTextToText has no class for it)")
    if not chat_template_of(processor):
        raise TargetError(f"the generic adapter needs a chat template, and the {type(processor).__name__} of this "
                          f"{mt} model has none; save one with the processor (processor.chat_template)")
    target = cls(model, processor, feature_layers)
    target.self_check = self_check(target)
    return target
