"""The target side of the core contract: prefill, tree verification and KV commit over a HF VLM's public API.

One `VLMTarget` holds one HF `...ForConditionalGeneration` model and one request's KV cache (batch size 1).
Families differ only in how a request becomes model inputs and how tree positions are numbered; they subclass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache

from mmspec_ray.targets import frames
from mmspec_ray.targets.request import InvalidRequest, PromptTooLong, Request, TargetError  # noqa: F401
from mmspec_ray.targets.placeholders import placeholder_tokens, typed_placeholder

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


def media_runs(media: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each contiguous run of True in a 1-D bool mask, in order."""
    m = media.to(torch.int8).cpu()
    edges = torch.diff(torch.cat([m.new_zeros(1), m, m.new_zeros(1)]))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def split_run(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """A run of media positions cut into `parts` equal pieces (any remainder joins the last: a trailing newline)."""
    size = max(1, (end - start) // max(1, parts))
    cuts = [start + i * size for i in range(max(1, parts))] + [end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def segment_ids(n: int, pieces: list[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, n] long: the index of the piece each position lies in, -1 outside every piece."""
    seg = torch.full((1, n), -1, dtype=torch.long, device=device)
    for i, (a, b) in enumerate(pieces):
        seg[0, a:b] = i
    return seg


def pieces_of(segments: torch.Tensor) -> list[tuple[int, int]]:
    """`segment_ids(...)[0]` ([n], piece index or -1) -> (start, end) of each piece, in order."""
    seg = segments.tolist()
    out: dict[int, list[int]] = {}
    for i, s in enumerate(seg):
        if s >= 0:
            out.setdefault(s, [i, i + 1])[1] = i + 1
    return [tuple(v) for _, v in sorted(out.items())]


# what some processors return that the model's forward must not take: `labels` (PaliGemma's processor returns it)
# would make the forward compute a training loss over logits it was asked to cut to the last positions
NOT_FORWARD_INPUTS = frozenset({"labels"})


def prefill_pieces(prefill: "TargetOutput", target: "VLMTarget") -> list[tuple[int, int]]:
    """The prompt's media pieces (one per image / frame / temporal group) as the drafters read them: the prefill's
    own `media_segments`, or, for a TargetOutput built by hand without them, the target's cut of the ids; [] for a
    text-only prompt."""
    if prefill.media_segments is not None:
        return pieces_of(prefill.media_segments[0])
    if prefill.media_mask is None:
        return []
    return target.media_pieces(prefill.input_ids[0])


def extend_inputs(inputs: dict[str, Any], extra: list[int]) -> dict[str, Any]:
    """Encoded prompt inputs with text ids appended (an answer, a draft); the other per-token tensors get 1
    (attention_mask) or 0 (type ids: text) at the new positions. Media inputs are untouched."""
    ids = inputs["input_ids"]
    L = ids.shape[1]
    add = torch.tensor([extra], dtype=ids.dtype, device=ids.device)
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids, add], 1)
    for k, v in inputs.items():
        if k != "input_ids" and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == (1, L):
            fill = torch.ones_like(add) if k == "attention_mask" else torch.zeros_like(add)
            out[k] = torch.cat([v, fill.to(v.dtype)], 1)
    return out


def id_set(src: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """A config's token id field (an id, a list of ids or None) as a set."""
    return set() if src is None else set(src) if isinstance(src, (list, tuple)) else {src}


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns for its new positions (n = prompt length at prefill, tree size at verify)."""

    logits: torch.Tensor  # [1, n, V] float32 at verify; [1, k, V] at prefill: the last k prompt positions only
    hidden: torch.Tensor  # [1, n, d] last layer after the final norm: exactly what lm_head consumes
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # {layer index: [1, n, d]} requested extras
    input_ids: torch.Tensor | None = None  # [1, n]
    inputs_embeds: torch.Tensor | None = None  # [1, n, d] prefill only: token embeddings with media merged in
    media_mask: torch.Tensor | None = None  # [1, n] bool prefill only: True at image/video token positions
    # [1, n] long prefill only: which image or video frame (0, 1, ... in prompt order) each media position belongs to,
    # -1 at text positions (`VLMTarget.media_pieces`; drafters that treat each image / frame apart read it)
    media_segments: torch.Tensor | None = None
    # [1, n] float prefill only, when asked (`prefill(attention=True)`): the attention each position receives in the
    # last decoder layer, averaged over heads and over the text query rows (DREAM's visual token compression)
    attention_received: torch.Tensor | None = None
    # {layer index: [1, n]} prefill only, when asked (`prefill(entropy_layers=...)`): each query row's attention
    # entropy in that decoder layer, averaged over heads (DREAM's intermediate-layer selection)
    attention_entropy: dict[int, torch.Tensor] = field(default_factory=dict)
    # prefill only: the encoded model inputs the prefill ran on (`encode`'s dict: input_ids, pixel values, grids ...),
    # so a second model that reads media the same way (a draft model) can prefill on exactly the same inputs
    inputs: dict[str, Any] | None = None
    # [3, 1, n] long prefill only, M-RoPE families with media in the prompt: the (temporal, height, width) position
    # ids the model gave each prompt position; None: position i is i (1-D RoPE, or a text-only M-RoPE prompt)
    positions: torch.Tensor | None = None
    # prefill only, with a `draft` chain: the chain verified in the same forward, as a verify returns a tree whose
    # root is the prompt's last token (logits, hidden and layers at that position and at each drafted one)
    draft: "TargetOutput | None" = None


class VLMTarget:
    """Generic adapter. Subclasses set `family` and override `chat_content`, `processor_inputs` or `tree_positions`."""

    family: ClassVar[str] = "generic"
    model_types: ClassVar[tuple[str, ...]] = ()
    takes_images: ClassVar[bool] = True
    takes_video: ClassVar[bool] = False  # native video input (else a clip is rejected, or sent as frames)
    video_as_frames: ClassVar[bool] = False  # send a clip as a sequence of images
    # native video whose processor samples frames again unless told not to: a request's clip is already sampled
    clips_as_sent: ClassVar[bool] = False

    def __init__(self, model, processor, feature_layers: tuple[int, ...] = ()) -> None:
        if processor is None:
            raise TargetError("this target has no processor; save one next to the checkpoint (processor.save_pretrained)")
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.feature_layers = tuple(feature_layers)
        self.text_config = model.config.get_text_config()
        self.cache: DynamicCache | None = None
        self.seq_len = 0  # committed tokens in the KV cache
        self.next_pos = 0  # position id of the next committed token (differs from seq_len under M-RoPE)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layer_types, self.sliding_window = attention_layout(self.text_config)
        self.checkpoint: str | None = None  # the local checkpoint directory it was loaded from (load_target)
        self._identity: str | None = None

    @property
    def identity(self) -> str | None:
        """The checkpoint's identity (`layout.checkpoint_identity`: the same wherever it is copied), or None for a
        model built in memory. Drafters record it and refuse to run on another target."""
        if self._identity is None and self.checkpoint is not None:
            from mmspec_ray.targets.layout import checkpoint_identity

            try:
                self._identity = checkpoint_identity(self.checkpoint)
            except (TargetError, OSError, ValueError, KeyError) as e:  # e.g. .bin weights: no safetensors headers
                log.warning("checkpoint %s: identity unknown (%s); drafters are matched by shape only", self.checkpoint,
                            e)
                self.checkpoint = None
        return self._identity

    # ---------- model pieces drafters share ----------
    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 1 << 30))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    @property
    def eos_token_ids(self) -> set[int]:
        """What decoding stops on: the generation config's eos ids, as HF generate (the checkpoint's
        generation_config.json when it has one); the text config's and tokenizer's only when it names none."""
        return id_set(self.model.generation_config.eos_token_id) or (
            id_set(self.text_config.eos_token_id) | id_set(self.tokenizer.eos_token_id))

    @property
    def media_token_ids(self) -> set[int]:
        ids = set()
        for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
            v = getattr(self.config, name, None)
            if isinstance(v, int):
                ids.add(v)
        return ids

    def media_mask_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool mask of the media placeholder positions of `ids` (any shape)."""
        media = torch.zeros_like(ids, dtype=torch.bool)
        for t in self.media_token_ids:
            media |= ids == t
        return media

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """(start, end) of each image's or video frame's media positions in `ids` [n], in prompt order. Default:
        every contiguous run of media tokens is one image (families that put text between images and frames).
        Families whose frames or images sit back to back override it; `inputs` (the encoded prompt) is given at
        prefill, None when only ids are known (stored training features)."""
        return media_runs(self.media_mask_of(ids))

    # ---------- request -> model inputs ----------
    def chat_content(self, request: Request) -> list[dict]:
        """The user message content parts: media placeholders first, then the text."""
        parts: list[dict] = [{"type": "image"} for _ in request.images]
        for clip in request.videos:
            parts += [{"type": "image"} for _ in clip] if self.video_as_frames else [{"type": "video"}]
        return parts + [{"type": "text", "text": request.prompt or ""}]

    def messages(self, request: Request) -> list[dict]:
        if request.messages is not None:  # a clip sent as frames: its video part becomes one image part per frame
            return frames.expand_video_parts(request) if self.video_as_frames else request.messages
        return [{"role": "user", "content": self.chat_content(request)}]

    def processor_inputs(self, text: str, request: Request) -> dict[str, Any]:
        """Call the processor on templated text + media. Overridden where a family's processor differs."""
        kw: dict[str, Any] = {"text": text, "return_tensors": "pt"}
        images = frames.media_in_order(request) if self.video_as_frames else list(request.images)
        if request.videos and not self.video_as_frames:
            kw["videos"] = [list(c) for c in request.videos]
            if self.clips_as_sent:
                kw["do_sample_frames"] = False
        if images:
            kw["images"] = images
        return dict(self.processor(**kw))

    def check_request(self, request: Request) -> None:
        if request.images and not self.takes_images:
            raise TargetError(f"{self.family} targets take no images; send text only")
        if request.videos and not (self.takes_video or self.video_as_frames):
            raise TargetError(f"{self.family} targets take no video; send frames as images or use a video model")
        if why := frames.media_count_error(request, self.family):  # explicit messages name the media they carry
            raise TargetError(why)

    def encode(self, request: Request) -> dict[str, Any]:
        """Request -> model inputs for prefill (tokens with media placeholders expanded, pixel tensors ...)."""
        self.check_request(request)
        typed = typed_placeholder(request.prompt, request.messages, placeholder_tokens(self.processor))
        if typed:
            field, kind, token = typed
            raise InvalidRequest(f"{field} contains the {kind} placeholder token {token!r}; remove it: media are "
                                 f"placed by the request's {kind}s (one {kind} part each), not by text")
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise TargetError("the processor has no chat template; set processor.chat_template")
        text = self.processor.apply_chat_template(self.messages(request), add_generation_prompt=True, tokenize=False)
        try:
            inputs = self.processor_inputs(text, request)
        except TargetError:
            raise
        except ValueError as e:  # e.g. placeholders and media that do not pair up: said as the request's problem
            raise TargetError(f"the {self.family} processor rejected the request ({e}); the request's media parts "
                              "and its images and clips must pair up (one image part per image; see docs/models.md "
                              "for how this family takes clips)") from e
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
                if k not in NOT_FORWARD_INPUTS}

    def check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        if n_prompt + max_new_tokens > self.max_context:
            raise PromptTooLong(
                f"prompt of {n_prompt} tokens + max_new_tokens {max_new_tokens} exceeds the target's context of "
                f"{self.max_context}; shorten the prompt, use fewer frames or lower max_new_tokens")

    # ---------- decoding primitives ----------
    def new_cache(self) -> DynamicCache:
        """A fresh KV cache for one request. Every layer keeps every committed token (no config, so no sliding-window
        layers that drop old keys): `verify`'s mask and `commit`'s slot arithmetic index the cache by absolute
        position, and sliding windows are enforced by the tree mask instead (`tree_mask`)."""
        return DynamicCache()

    def check_prefill(self, out) -> None:
        """Hook: validate a prefill's raw model output (e.g. that lm_head(hidden) reproduces its logits)."""

    @torch.inference_mode()
    def prefill(self, inputs: dict[str, Any], logits_to_keep: int = 1, attention: bool = False,
                entropy_layers: tuple[int, ...] = (), draft: list[int] | tuple[int, ...] = ()) -> TargetOutput:
        """Run the prompt (with media) and start a fresh KV cache. Logits are computed for the last
        `logits_to_keep` positions only (0: every position, [1, L, V]: 1.8 GB at 3k tokens x 152k vocab).
        `attention`: also the last layer's attention received per position from the text rows
        (`attention_received`); `entropy_layers`: also those decoder layers' per-row attention entropy, with their
        output hidden states in `layers` (index l + 1). Both read the layers' own q/k (targets/attention.py); the
        forward itself is unchanged.
        `draft`: a chain of guessed answer tokens appended to the prompt in the same forward (causal, so the
        prompt's positions are computed as without it). The cache is then left as after a `verify` of the tree
        [last prompt token] + draft: the last prompt token and the draft uncommitted until `commit` keeps a path
        from it (the returned output's `draft`). Everything else in the output covers the prompt alone."""
        from mmspec_ray.targets.attention import probe_attention, reduce_attention

        if draft and (attention or entropy_layers):
            raise ValueError("a prefill with a draft chain takes no attention probes")
        self.cache = self.new_cache()
        ids = inputs["input_ids"]
        n, k = ids.shape[1], len(draft)
        last = int(getattr(self.text_config, "num_hidden_layers", 1)) - 1
        with probe_attention(self.model, ([last] if attention else []) + list(entropy_layers)) as probed:
            out = self.model(**(extend_inputs(inputs, list(draft)) if k else inputs), past_key_values=self.cache,
                             use_cache=True, output_hidden_states=True,
                             logits_to_keep=logits_to_keep + k if logits_to_keep else 0)
        self.seq_len = n
        self.next_pos = self.after_prefill_position(inputs)
        self.check_prefill(out)
        drafted = None
        if k:  # the chain's tree: root = the last prompt token, handed back to the uncommitted part of the cache
            drafted = TargetOutput(logits=out.logits[:, -(k + 1):].float(), hidden=out.hidden_states[-1][:, n - 1:],
                                   layers={i: out.hidden_states[i][:, n - 1:] for i in self.feature_layers},
                                   input_ids=torch.cat([ids[:, -1:], torch.tensor([list(draft)]).to(ids)], 1))
            self.seq_len, self.next_pos = n - 1, self.next_pos - 1
            logits = out.logits[:, :-k] if logits_to_keep else out.logits[:, :n]
            hs = tuple(h[:, :n] for h in out.hidden_states)
        else:
            logits, hs = out.logits, out.hidden_states
        media = self.media_mask_of(ids)
        received, entropy = None, {}
        if attention:
            text = (~media[0]).float()
            received = reduce_attention(probed[last], text / text.sum().clamp_min(1.0))[0][None]
        for i in entropy_layers:
            entropy[i] = reduce_attention(probed[i])[1][None]
        wanted = set(self.feature_layers) | {i + 1 for i in entropy_layers}
        return TargetOutput(
            logits=logits.float(),
            hidden=hs[-1],
            layers={i: hs[i] for i in sorted(wanted)},
            input_ids=ids,
            inputs_embeds=hs[0],
            media_mask=media,
            media_segments=segment_ids(ids.shape[1], self.media_pieces(ids[0], inputs), ids.device),
            attention_received=received,
            attention_entropy=entropy,
            inputs=inputs,
            positions=self.prompt_positions(inputs),
            draft=drafted,
        )

    def prompt_positions(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """[3, 1, n] M-RoPE position ids of the prompt positions, or None where position i is i (this default)."""
        return None

    def takes_draft(self, inputs: dict[str, Any]) -> bool:
        """Whether tokens appended to this prompt in the prefill (`prefill(draft=...)`) get the positions decoding
        gives the answer: where the prompt's largest position is its last token's. Not so after a long clip in
        Qwen2-VL / 2.5-VL, whose time axis runs past the text that follows it (the answer starts after the largest
        position, an appended token right after the last one)."""
        pos = self.prompt_positions(inputs)
        return pos is None or bool(pos[..., -1].max() == pos.max())

    def after_prefill_position(self, inputs: dict[str, Any]) -> int:
        """Position id of the first generated token (M-RoPE families add their rope delta)."""
        return inputs["input_ids"].shape[1]

    def tree_positions(self, depth: torch.Tensor) -> torch.Tensor:
        """[1, n] position ids of tree nodes (root at depth 0 takes `next_pos`)."""
        return (self.next_pos + depth).unsqueeze(0)

    def tree_mask(self, ancestors: torch.Tensor, depth: torch.Tensor,
                  cached_depth: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive float mask [1, 1, n, seq_len + m]: every node sees the committed prefix, its ancestors and itself;
        on sliding-window layers only keys less than `sliding_window` cache slots back, counting a node at depth d
        as slot seq_len + d (as HF counts a generated token: by cache index, not rope position). One mask when all
        layers are alike, else {layer type: mask} (the per-layer-type form HF's hybrid models accept).
        `ancestors` is [n, m]: m == n for a tree verified at once; m > n when the first m - n columns are uncommitted
        nodes an earlier `verify` left in the cache (a drafter growing its tree level by level), `cached_depth`
        [m - n] their depths."""
        n, m, L = ancestors.shape[0], ancestors.shape[1], self.seq_len
        allowed = torch.ones((n, L + m), dtype=torch.bool, device=self.device)
        allowed[:, L:] = ancestors
        masks = {FULL: allowed, SLIDING: allowed}
        if self.sliding_window is not None:
            q = L + depth
            cached = L + cached_depth.to(self.device) if cached_depth is not None else q[:0]
            k = torch.cat([torch.arange(L, device=self.device), cached, q])
            masks[SLIDING] = allowed & (q.unsqueeze(1) - k.unsqueeze(0) < self.sliding_window)
        out = {}
        for kind in set(self.layer_types):
            mask = torch.zeros((1, 1, n, L + m), dtype=self.dtype, device=self.device)
            out[kind] = mask.masked_fill_(~masks[kind], torch.finfo(self.dtype).min)
        return next(iter(out.values())) if len(out) == 1 else out

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor,
               cached_depth: torch.Tensor | None = None) -> TargetOutput:
        """Score a token tree in one forward: tokens [n], ancestors [n, n] bool (row i: i's ancestors and i),
        depth [n] (root 0). Node KV is appended after the committed prefix until `commit`.
        Growing a tree over several forwards (a draft model): `ancestors` [n, m] also covers the m - n uncommitted
        nodes earlier verifies left in the cache (columns first, in cache order), `cached_depth` [m - n] their
        depths; `commit` then indexes every uncommitted node in cache order."""
        if self.cache is None:
            raise RuntimeError("verify before prefill")
        n, m = tokens.shape[0], ancestors.shape[1]
        held = self.cache.get_seq_length() - self.seq_len  # uncommitted nodes already in the cache
        if held != m - n or (m > n and (cached_depth is None or cached_depth.shape[0] != m - n)):
            raise RuntimeError(f"verify of {n} nodes with ancestor columns for {m}: the cache holds {held} "
                               "uncommitted nodes; give their ancestor columns and depths (cached_depth), or commit")
        positions = self.tree_positions(depth.to(self.device))
        ids = tokens.view(1, n).to(self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=self.tree_mask(ancestors.to(self.device), depth.to(self.device), cached_depth),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        return TargetOutput(
            logits=out.logits.float(),
            hidden=out.hidden_states[-1],
            layers={i: out.hidden_states[i] for i in self.feature_layers},
            input_ids=ids,
        )

    @torch.inference_mode()
    def commit(self, keep: list[int]) -> None:
        """Keep the KV of tree nodes `keep` (root first, in path order; indices over every uncommitted node in the
        cache, in cache order) and drop every other node. In place: the accepted slots are gathered into the first
        len(keep) tree slots and the tail is cut off (a view), so the cost is O(len(keep)) per layer, whatever the
        context length."""
        if self.cache is None:
            raise RuntimeError("commit before prefill")
        L, k = self.seq_len, len(keep)
        moved = keep != list(range(k))  # a chain prefix is already in place
        src = torch.tensor(keep, dtype=torch.long, device=self.device) + L if moved else None
        for layer in self.cache.layers:
            if moved:
                layer.keys[..., L:L + k, :] = layer.keys.index_select(-2, src)
                layer.values[..., L:L + k, :] = layer.values.index_select(-2, src)
            layer.keys = layer.keys[..., : L + k, :]
            layer.values = layer.values[..., : L + k, :]
        self.seq_len = L + k
        self.next_pos += k


def attention_layout(text_config) -> tuple[tuple[str, ...], int | None]:
    """(attention kind of each decoder layer, sliding window or None), read as HF reads them: `layer_types` when
    the config has it, else every layer sliding iff `sliding_window` is set (Mistral-style configs)."""
    window = getattr(text_config, "sliding_window", None)
    n = int(getattr(text_config, "num_hidden_layers", 1))
    types = tuple(getattr(text_config, "layer_types", None) or [SLIDING if window else FULL] * n)
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise TargetError(f"attention layer types {sorted(unknown)} are not supported (only {FULL}, {SLIDING})")
    return types, (int(window) if window and SLIDING in types else None)
