"""Tiny random-init GLM-4.1V (`glm4v`, Glm4vForConditionalGeneration) and GLM-4.5V MoE (`glm4v_moe`) models and
their processor, built in-process for tests (no downloads).

The text model has 2 layers of width 64 (2 heads of 32, 1 KV head) with GLM's partial rotary embedding (half of each
head rotates) under 3-axis M-RoPE (sections 2/3/3 over the 8 rotary frequencies). The vision tower has 2 blocks of
width 32 on 8 px patches, downsampled 2x2 into the text width. A 96 px image becomes 48 px: 9 `<|image|>` tokens
between `<|begin_of_image|>` and `<|end_of_image|>`; a 4-frame clip becomes 2 temporal groups of 9 `<|image|>` tokens,
each group in its own begin / end of image pair followed by its timestamp, all inside `<|begin_of_video|>` ...
`<|end_of_video|>`.

The tokenizer is the shared tiny BPE with GLM's special tokens; the chat template has GLM-4.1V's shape
(`[gMASK]<sop><|user|>\\n...<|assistant|>\\n`, a media part rendered as its begin / placeholder / end triple).
The image processor is transformers' own PIL backend (`Glm4vImageProcessorPil`). GLM's video processor needs
torchvision, which this project does not install, so the processor gets `TinyGlm4vVideoProcessor`: the numpy/PIL
Qwen2-VL stand-in (tests/tiny_qwen2_5_vl.py, the same patch layout) with GLM's clip resize (transformers' own
`smart_resize` of the GLM video processor: the pixel budget covers the whole clip, clips shorter than a temporal
group are refused) and GLM's frame sampling (which needs the clip's fps, so frames without metadata are refused
unless sampling is off). The clip's metadata always comes back when asked: `Glm4vProcessor` reads it for the
timestamps.
"""

from __future__ import annotations

import torch
from transformers import (
    Glm4vConfig,
    Glm4vForConditionalGeneration,
    Glm4vImageProcessorPil,
    Glm4vMoeConfig,
    Glm4vMoeForConditionalGeneration,
    Glm4vProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.models.glm4v.video_processing_glm4v import smart_resize as glm_smart_resize
from transformers.video_utils import make_batched_metadata, make_batched_videos

from tiny import VideoProcessorTypeCheck, mute_eos, tiny_fast_tokenizer
from tiny_qwen2_5_vl import TinyQwenVideoProcessor

GMASK, SOP, SYSTEM, USER, ASSISTANT, ENDOFTEXT = "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", \
    "<|endoftext|>"
BOI, EOI, BOV, EOV = "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"
IMAGE, VIDEO = "<|image|>", "<|video|>"
SPECIAL_TOKENS = [GMASK, SOP, SYSTEM, USER, ASSISTANT, ENDOFTEXT, BOI, EOI, BOV, EOV, IMAGE, VIDEO]

PATCH, MERGE, TEMPORAL = 8, 2, 2
# the image budget counts one temporal group (2 copies of the image): a 96 px image becomes 48 px, 6x6 patches
IMAGE_PIXELS = {"shortest_edge": 2 * 32 * 32, "longest_edge": 2 * 48 * 48}
# the video budget counts every frame of the clip: 4 frames of 48 x 48 px at most (a 96 px clip -> 48 px)
VIDEO_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 4 * 48 * 48}

# GLM-4.1V's shape: "[gMASK]<sop><|user|>\n<media>text<|assistant|>\n"; an image part renders as
# <|begin_of_image|><|image|><|end_of_image|> (the processor expands <|image|> to one token per merged patch), a video
# part as <|begin_of_video|><|video|><|end_of_video|> (the processor expands <|video|> to one image block per
# temporal group, each followed by its timestamp in seconds).
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|begin_of_video|><|video|><|end_of_video|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def glm4v_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the shared tiny BPE with GLM's special tokens; eos and pad are <|endoftext|>."""
    return tiny_fast_tokenizer(SPECIAL_TOKENS, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT, chat_template=CHAT_TEMPLATE,
                               padding_side="left")


class TinyGlm4vVideoProcessor(TinyQwenVideoProcessor):
    """GLM-4.1V video preprocessing without torchvision (see the module docstring)."""

    fps, max_duration = 2, 300  # the stock processor's sampling defaults (read by its sample_frames)

    def __init__(self, size: dict[str, int] | None = None, do_sample_frames: bool = True, **kwargs) -> None:
        super().__init__(size=dict(size or VIDEO_PIXELS), **kwargs)
        self.do_sample_frames = do_sample_frames

    def preprocess(self, videos, video_metadata=None, do_sample_frames: bool | None = None,
                   return_metadata: bool = False, return_tensors=None, **kwargs):
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata)
        if self.do_sample_frames if do_sample_frames is None else do_sample_frames:
            sampled = []
            for clip, meta in zip(videos, metadata):
                indices = Glm4vVideoProcessor.sample_frames(self, meta)  # refuses a clip without its fps
                meta.frames_indices = indices
                sampled.append([clip[i] for i in indices])
            videos = sampled
        out = super().preprocess(videos, video_metadata=metadata, return_tensors=return_tensors)
        if return_metadata:
            out["video_metadata"] = metadata
        return out

    def resized(self, n_frames: int, height: int, width: int) -> tuple[int, int]:
        """GLM's video resize: one size for the clip, its pixel budget for the clip's frames together."""
        return glm_smart_resize(n_frames, height, width, temporal_factor=self.temporal_patch_size,
                                factor=self.patch_size * self.merge_size, min_pixels=self.size["shortest_edge"],
                                max_pixels=self.size["longest_edge"])


class TinyGlm4vProcessor(VideoProcessorTypeCheck, Glm4vProcessor):
    """The stock GLM-4.1V processor, accepting a video processor while torchvision is absent."""


def tiny_glm4v_processor() -> Glm4vProcessor:
    """GLM-4.1V processor: PIL image processor (8 px patches, 2x2 merge), tiny video processor, tiny tokenizer."""
    image_processor = Glm4vImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                             size=dict(IMAGE_PIXELS))
    return TinyGlm4vProcessor(image_processor=image_processor, tokenizer=glm4v_tokenizer(),
                              video_processor=TinyGlm4vVideoProcessor(), chat_template=CHAT_TEMPLATE)


def _configs(tok, init: float, layers: int) -> tuple[dict, dict, dict]:
    """(text, vision, top-level) config kwargs shared by the dense and the MoE model."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, initializer_range=init,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "partial_rotary_factor": 0.5},
        pad_token_id=ids[ENDOFTEXT],
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=48, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=64, initializer_range=init,
    )
    top = dict(image_token_id=ids[IMAGE], video_token_id=ids[VIDEO], image_start_token_id=ids[BOI],
               image_end_token_id=ids[EOI], video_start_token_id=ids[BOV], video_end_token_id=ids[EOV],
               tie_word_embeddings=False)
    return text, vision, top


def _finish(model, tok):
    """GLM-4.1V's generation config (eos <|endoftext|> and <|user|>, both muted), eval mode."""
    eos = [tok.convert_tokens_to_ids(ENDOFTEXT), tok.convert_tokens_to_ids(USER)]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0]
    model.generation_config.bos_token_id = None
    for t in eos:
        mute_eos(model, t)
    return model.eval()


def tiny_glm4v(seed: int = 0, init: float = 0.3, num_hidden_layers: int = 2):
    """(model, processor): GLM-4.1V, `num_hidden_layers` text layers of width 64 (partial rotary, M-RoPE), a 2-block
    vision tower of width 32. `init` 0.3 keeps greedy output varied while float32 tree-vs-path noise stays well under
    the contract's 1e-4 (at 0.4 this model's two heads of 32 reach ~1e-4 by summation order alone; float64: 0)."""
    processor = tiny_glm4v_processor()
    text, vision, top = _configs(processor.tokenizer, init, num_hidden_layers)
    config = Glm4vConfig(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)  # construction draws every weight at the sub-configs' initializer_range
    return _finish(Glm4vForConditionalGeneration(config), processor.tokenizer), processor


def tiny_glm4v_moe(seed: int = 0, init: float = 0.3, num_hidden_layers: int = 2):
    """(model, processor): GLM-4.5V's MoE text model (`glm4v_moe`): layer 0 dense, later layers a shared expert plus
    2 of 4 routed experts of width 32; otherwise as `tiny_glm4v` (the same processor)."""
    processor = tiny_glm4v_processor()
    text, vision, top = _configs(processor.tokenizer, init, num_hidden_layers)
    text.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1)
    config = Glm4vMoeConfig(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)
    return _finish(Glm4vMoeForConditionalGeneration(config), processor.tokenizer), processor
