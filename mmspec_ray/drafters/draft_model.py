"""Draft-model drafter: a smaller checkpoint of the target's family (same tokenizer, same media processing) grows an
EAGLE-2 dynamic tree with its own KV cache. Training-free; what HF assisted generation and vLLM's draft-model mode
do, as a tree.

The draft is a second `VLMTarget` and uses the target primitives: `prefill` on the target's own encoded inputs
(`TargetOutput.inputs`), `verify` with a tree mask, `commit` by gather. Its cache holds committed tokens only between
cycles; `pending` are the committed tokens it has not read yet (the root, then after each cycle the accepted tokens
it did not expand and the bonus). A proposal first reads `pending` (one forward, committed: the root's next-token
distribution is its last row), then each tree level is one more forward whose nodes attend to the committed cache
and to their ancestors among the nodes expanded earlier in the cycle, kept after the committed prefix until
`observe`. There the accepted nodes that were expanded (a prefix of the accepted path) keep their KV; the rest of
the cycle's nodes are dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmspec_ray.decoding.tree import DraftTree, TreeConfig, TreeSteps, grow_dynamic_tree
from mmspec_ray.drafters.base import check_device, register_drafter
from mmspec_ray.targets.request import TargetError

if TYPE_CHECKING:
    from mmspec_ray.config import S3Config
    from mmspec_ray.targets.base import TargetOutput, VLMTarget

# processor settings that name a class or where it was saved, not how media become tensors
_NAMING_KEYS = {"processor_class", "image_processor_type", "video_processor_type", "auto_map", "_name_or_path",
                "_processor_class"}
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
PREFIX = "draft-model:"


def _plain(value: Any) -> Any:
    """A processor setting as plain JSON data, naming keys dropped (so a reloaded copy compares equal)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items() if k not in _NAMING_KEYS}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def media_settings(processor: Any) -> dict[str, Any]:
    """How `processor` turns media into tensors and placeholders: its settings (`to_dict`: image / video processor,
    patch and token counts), without the tokenizer and the class names."""
    raw = processor.to_dict() if hasattr(processor, "to_dict") else {}
    return _plain({k: v for k, v in raw.items() if k not in ("tokenizer", "chat_template")})


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}: {x!r} vs {y!r}")
    return out


def vocab_difference(draft_tok: Any, target_tok: Any) -> str | None:
    """None when both tokenizers map every token to the same id, else what differs, briefly."""
    a, b = draft_tok.get_vocab(), target_tok.get_vocab()
    if a == b:
        return None
    only_draft = sorted(set(a) - set(b))
    only_target = sorted(set(b) - set(a))
    moved = sorted(t for t in set(a) & set(b) if a[t] != b[t])
    parts = [f"{len(a)} vs {len(b)} tokens"]
    if only_draft:
        parts.append(f"{len(only_draft)} only in the draft's, e.g. {only_draft[0]!r}")
    if only_target:
        parts.append(f"{len(only_target)} only in the target's, e.g. {only_target[0]!r}")
    if moved:
        parts.append(f"{len(moved)} with another id, e.g. {moved[0]!r}: {a[moved[0]]} vs {b[moved[0]]}")
    return "; ".join(parts)


def check_pairing(draft: "VLMTarget", target: "VLMTarget") -> None:
    """Refuse a draft model that cannot draft for `target`, naming the mismatch: another family (adapter), another
    tokenizer (token -> id map), other media processing (it reads the target's encoded inputs) or other media
    token ids. The LM heads may differ in padding rows: only ids both know are proposed."""
    fix = "a draft model is a smaller checkpoint of the target's family that shares its tokenizer and processor"
    if type(draft) is not type(target):
        raise TargetError(f"draft model is a {draft.family} model ({draft.config.model_type}), the target a "
                          f"{target.family} model ({target.config.model_type}); {fix}")
    if why := vocab_difference(draft.tokenizer, target.tokenizer):
        raise TargetError(f"draft model's tokenizer differs from the target's ({why}); {fix}")
    if draft.processor is not target.processor:
        diff = _differences(media_settings(draft.processor), media_settings(target.processor))
        if diff:
            raise TargetError(f"draft model processes media unlike the target ({'; '.join(diff[:3])}); it reads "
                              f"the target's encoded inputs, so its processor settings must be the target's; {fix}")
    if draft.media_token_ids != target.media_token_ids:
        raise TargetError(f"draft model's media token ids {sorted(draft.media_token_ids)} differ from the target's "
                          f"{sorted(target.media_token_ids)}; {fix}")


def is_draft_model_checkpoint(uri: str, s3: "S3Config | None" = None) -> bool:
    """Whether `uri` (a local directory or s3:// prefix) holds a VLM checkpoint of a supported family: a config.json
    with such a `model_type` and no drafter `method`, and a saved processor (a drafter head ships none, even one
    whose config names a VLM model type). Reads config.json and the file names only; False where unreadable."""
    from pyarrow import fs

    from mmspec_ray.media.io import filesystem_for
    from mmspec_ray.targets.registry import families

    try:
        filesystem, root = filesystem_for(uri, s3)
        infos = filesystem.get_file_info(fs.FileSelector(root, recursive=False, allow_not_found=True))
        names = {i.base_name for i in infos if i.type == fs.FileType.File}
        if "config.json" not in names or not names & set(_PROCESSOR_FILES):
            return False
        with filesystem.open_input_file(f"{root}/config.json") as f:
            config = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and not config.get("method") and config.get("model_type") in families()


@register_drafter("draft-model")
class DraftModelDrafter:
    """Per-request drafting state around a second, smaller VLM of the target's family."""

    # calibration's largest tree (decoding/calibrate.py): deeper than a head's, since a sibling model agrees with
    # its target for long runs (toy-s with toy-m: 7 tokens per forward on a 16-token tree of depth 5), and a chain
    # as deep as HF assisted generation's (up to 20 tokens) must be within reach
    probe_tree = TreeConfig(top_k=4, depth=16, total_tokens=64)

    def __init__(self, draft: "VLMTarget", target: "VLMTarget") -> None:
        check_pairing(draft, target)
        self.draft = draft
        self.target = target
        self.vocab = min(draft.vocab_size, target.vocab_size)  # ids both LM heads know (padding rows may differ)
        self.pending: list[int] = []  # committed tokens not yet in the draft's cache, ending with the next root
        self.nodes: dict[tuple[int, int], int] = {}  # (parent slot or -1, token) -> cache slot of an expanded node
        self.root = -1  # the root of the last proposal (its pending chain read into the cache)
        self.root_logp: torch.Tensor | None = None  # [V] that root's next-token log-probs
        self.passes = 0  # draft forwards while proposing (the pending chain, then one per tree level)
        self.prefill_tokens = 0  # prompt entries the draft model's prefill read (all of them, media included)

    is_checkpoint = staticmethod(is_draft_model_checkpoint)

    @classmethod
    def from_model(cls, model, processor, target: "VLMTarget") -> "DraftModelDrafter":
        """A drafter around an already loaded HF model + processor (tests; a model built in memory)."""
        from mmspec_ray.targets.registry import wrap

        return cls(wrap(model, processor), target)

    @classmethod
    def load(cls, path: str | Path, target: "VLMTarget", device: str | None = None,
             s3: "S3Config | None" = None) -> "DraftModelDrafter":
        """The checkpoint at `path` (a save_pretrained directory or s3:// prefix) on the target's device and dtype.
        Its family is checked from config.json before any weights are read."""
        from mmspec_ray.targets.registry import families, fetch_checkpoint, load_target

        check_device(device, target)
        hint = (f"give `{PREFIX}PATH` a save_pretrained directory or s3:// prefix of a smaller checkpoint of the "
                "target's family (model, tokenizer and processor)")
        try:
            local = fetch_checkpoint(str(path), s3)
            config = local / "config.json"
            model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
            family = families().get(model_type)
            if family is not None and family is not type(target):
                raise TargetError(f"a {family.family} model ({model_type}), the target a {target.family} model "
                                  f"({target.config.model_type}); a draft model must be of the target's family")
            draft = load_target(local, device=target.device, dtype=target.dtype)
        except (TargetError, OSError) as e:
            raise TargetError(f"draft model {path}: {e}; {hint}") from e
        return cls(draft, target)

    # ---------- lifecycle ----------
    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        if prefill.inputs is None:
            raise TargetError("the target's prefill output carries no encoded inputs (TargetOutput.inputs); the "
                              "draft model prefills on them, so give the drafter the output of VLMTarget.prefill")
        dev = self.draft.device
        inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in prefill.inputs.items()}
        try:
            self.draft.prefill(inputs, logits_to_keep=1)
        except (ValueError, RuntimeError, IndexError) as e:  # e.g. its vision tower yields another feature count
            raise TargetError(f"the draft model cannot read this request's encoded inputs ({type(e).__name__}: "
                              f"{e}); a draft model must read media as the target does (same vision input and "
                              "token layout)") from e
        self.prefill_tokens = int(inputs["input_ids"].shape[1])
        self.pending, self.nodes, self.root = [root], {}, -1

    @torch.inference_mode()
    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        d = self.draft
        if self.nodes or d.cache.get_seq_length() > d.seq_len:  # a proposal never observed: drop its nodes
            d.commit([])
            self.nodes = {}
        if (self.pending[-1] if self.pending else self.root) != root:
            raise RuntimeError(f"draft-model drafter: asked to propose after {root}, but its context ends with "
                               f"{self.pending[-1] if self.pending else self.root}; observe every verified cycle")
        room = d.max_context - d.seq_len - len(self.pending)  # cache slots left after the pending chain
        depth = min(cfg.depth, room // cfg.top_k)
        if depth < 1:  # the draft's context is full: propose the root alone (a plain AR step)
            return DraftTree.chain([root])
        if depth < cfg.depth:
            cfg = cfg.model_copy(update={"depth": depth})
        root_logp = self._read_pending() if self.pending else self.root_logp  # (the same root proposed again)
        self.root, self.root_logp = root, root_logp
        steps = TreeSteps(0, d.device)

        def step(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            before, _, anc, _ = steps.add(parents)  # anc [k, before + k]: ancestors among this cycle's nodes
            below = torch.tensor(steps.levels, device=d.device) - 1  # depth below the root, now in the cache
            out = d.verify(tokens, anc, below[before:], cached_depth=below[:before])
            for i, (tok, par) in enumerate(zip(tokens.tolist(), parents.tolist())):
                self.nodes[(par, tok)] = before + i
            self.passes += 1
            return self.logprobs(out.logits[0]).cpu()

        return grow_dynamic_tree(root, root_logp.cpu(), step, cfg)

    @torch.inference_mode()
    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """Keep the KV of the accepted nodes this cycle expanded (walked from the root by token: a prefix of the
        accepted path), drop the cycle's other nodes; the rest of the path and the bonus are read next proposal.
        `hidden` (the target's features) is not used: the draft model has its own."""
        keep, slot = [], -1
        for tok in tokens[1:]:
            slot = self.nodes.get((slot, tok), -2)
            if slot < 0:
                break
            keep.append(slot)
        self.draft.commit(keep)
        self.nodes = {}
        self.pending = self.pending + tokens[1 + len(keep):] + [bonus]

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, V_draft] -> log-probabilities [n, V] over the ids both models know (float32)."""
        return torch.log_softmax(logits.float(), -1)[:, :self.vocab]

    # ---------- internals ----------
    def _read_pending(self) -> torch.Tensor:
        """Run the pending chain into the draft's cache and commit it; the root's next-token log-probs [V]."""
        n = len(self.pending)
        chain = torch.ones((n, n), dtype=torch.bool).tril()
        out = self.draft.verify(torch.tensor(self.pending), chain, torch.arange(n))
        self.draft.commit(list(range(n)))
        self.pending = []
        self.passes += 1
        return self.logprobs(out.logits[0, -1:])[0]
