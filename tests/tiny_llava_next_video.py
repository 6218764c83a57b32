"""Tiny random-init LLaVA-NeXT-Video (CLIP tower + Llama, anyres images, native video) and its processor.

Vision tile 32px with 8px patches: 16 patch tokens per tile (+ CLS, dropped by the "default" strategy).
- an image: LLaVA-NeXT's anyres tiling over up to 2x2 tiles (a square image: 16 base + 8x8 grid + 8 newlines = 88
  tokens), as tests/tiny_llava_next.py;
- a clip: each frame resized and cropped to one tile, its 4x4 patch grid average-pooled 2x2 to 4 tokens, the frames
  back to back: 4 * frames tokens.

transformers builds LlavaNextVideoVideoProcessor only with torchvision, which this project does not install, and
the stock LlavaNextVideoProcessor cannot even type-check a video processor without it (tiny.VideoProcessorTypeCheck).
So the processor is the stock one with that check resolved, and its video processor `TinyNextVideoVideoProcessor` is
a numpy/PIL stand-in doing the stock steps: resize the shortest edge to `size`, centre-crop to `crop`, rescale,
CLIP-normalise, returning `pixel_values_videos` [videos, frames, 3, H, W]. The tokenizer (tiny BPE + `<video>`)
and the ChatML template are tests/tiny_llava_onevision.py's.
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from transformers import (
    BatchFeature,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextImageProcessorPil,
    LlavaNextVideoConfig,
    LlavaNextVideoForConditionalGeneration,
    LlavaNextVideoProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import make_batched_videos

from tiny import VideoProcessorTypeCheck, anyres_decoder, ready, seeded_model
from tiny_llava_onevision import CHAT_TEMPLATE, VIDEO, onevision_tokenizer

TILE = 32  # vision tower input size (one anyres tile, one video frame)
PATCH = 8
POOL = 2  # spatial_pool_stride: a frame's 4x4 patch grid -> 2x2 tokens
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # (height, width) tile layouts, up to 2x2 tiles
TOKENS_PER_FRAME = (TILE // PATCH // POOL) ** 2


class TinyNextVideoVideoProcessor(VideoProcessorMixin):
    """Torchvision-free stand-in for LlavaNextVideoVideoProcessor: per frame, resize the shortest edge to `size`
    (bicubic), centre-crop to `crop` x `crop`, rescale to [0, 1], normalise with CLIP's mean and std."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, size: int = TILE, crop: int = TILE, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shortest_edge, self.crop = size, crop

    def frame(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [3, crop, crop] float32."""
        img = Image.fromarray(pixels).convert("RGB")
        w, h = img.size
        scale = self.shortest_edge / min(w, h)
        img = img.resize((max(self.crop, int(w * scale)), max(self.crop, int(h * scale))), Image.BICUBIC)
        left, top = (img.width - self.crop) // 2, (img.height - self.crop) // 2
        img = img.crop((left, top, left + self.crop, top + self.crop))
        x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
        mean = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)[:, None, None]
        std = np.array(OPENAI_CLIP_STD, dtype=np.float32)[:, None, None]
        return (x - mean) / std

    def preprocess(self, videos, return_tensors=None, **kwargs) -> BatchFeature:
        clips = [np.stack([self.frame(f) for f in np.asarray(video)]) for video in make_batched_videos(videos)]
        return BatchFeature({"pixel_values_videos": clips}, tensor_type=return_tensors)


class TinyNextVideoProcessor(VideoProcessorTypeCheck, LlavaNextVideoProcessor):
    """Stock LlavaNextVideoProcessor whose `video_processor` type check works without torchvision."""


def build_processor() -> TinyNextVideoProcessor:
    """LLaVA-NeXT's anyres image processor + the stand-in video processor + tokenizer + a ChatML template that
    renders image and video parts."""
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TILE},
                                                 crop_size={"height": TILE, "width": TILE},
                                                 image_grid_pinpoints=PINPOINTS)
    return TinyNextVideoProcessor(
        video_processor=TinyNextVideoVideoProcessor(),
        image_processor=image_processor,
        tokenizer=onevision_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        video_token=VIDEO,
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's CLS
    )


def build_model(seed: int = 0, init: float = 0.3) -> LlavaNextVideoForConditionalGeneration:
    """2-layer Llama text model (hidden 64) + 1-layer CLIP tower (hidden 32), weights re-drawn at std `init` (0.3 for
    the reason given in tests/tiny_llava_next.py)."""
    tok = onevision_tokenizer()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=TILE, patch_size=PATCH, projection_dim=32, initializer_range=init)
    text = LlamaConfig(**anyres_decoder(tok, init))
    config = LlavaNextVideoConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                                  video_token_index=tok.convert_tokens_to_ids(VIDEO), vision_feature_layer=-1,
                                  vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS,
                                  image_seq_length=(TILE // PATCH) ** 2, video_seq_length=TOKENS_PER_FRAME,
                                  spatial_pool_mode="average", spatial_pool_stride=POOL)
    return ready(seeded_model(LlavaNextVideoForConditionalGeneration, config, seed), tok)


def tiny_llava_next_video(seed: int = 0, init: float = 0.3):
    """(model, processor) for the tiny LLaVA-NeXT-Video."""
    return build_model(seed, init), build_processor()
