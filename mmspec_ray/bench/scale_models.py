"""7B-class targets built from published configs with random weights, for cost measurements at real scale.

No weights can be downloaded, but a model built from a real config has the real costs: the same layers, widths,
vocabulary and vision tower, so the same step, verify and prefill times and the same memory. Each target gets a
processor built in-process (the family's stock image / video processors at the published settings, so a request
becomes the real number of media tokens) and a word-level tokenizer that spans the whole vocabulary with the
special tokens at their published ids. `reduced=True` keeps the processor settings (so the token counts) and the
vocabulary but shrinks every width and depth: the same code path on a CPU in seconds (tests/test_gpu_scale.py).
`python -m mmspec_ray.bench.gpu_scale` measures them (scripts/gpu_scale.sh).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmspec_ray.targets.base import Request, VLMTarget

# The architecture fields of the published config.json files (random weights; the rest of each config is the
# transformers default, as loading the published file would give).
QWEN2_5_VL_7B: dict[str, Any] = {  # Qwen/Qwen2.5-VL-7B-Instruct
    "model_type": "qwen2_5_vl",
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu",
    },
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}

LLAVA_NEXT_MISTRAL_7B: dict[str, Any] = {  # llava-hf/llava-v1.6-mistral-7b-hf
    "model_type": "llava_next",
    "text_config": {
        "model_type": "mistral", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    "vision_config": {
        "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768,
        "hidden_act": "quick_gelu",
    },
    "image_token_index": 32000, "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "projector_hidden_act": "gelu", "image_seq_length": 576, "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ScaleModel:
    """One real-config target: its config and the special tokens its tokenizer must hold at their ids."""

    name: str
    config: dict[str, Any]
    specials: dict[str, int]  # token text -> published id
    eos: str
    template: str  # chat template (renders image / video parts as the family's placeholders)


QWEN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
MISTRAL_TEMPLATE = (  # [INST] <image>\n prompt [/INST], as llava-v1.6-mistral's
    "{{- '<s>' -}}{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '[INST] ' -}}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{{- ' [/INST]' -}}"
    "{%- else -%}{{- message['content'] -}}{{- '</s>' -}}{%- endif -%}"
    "{%- endfor -%}"
)

MODELS: dict[str, ScaleModel] = {
    "qwen2_5_vl_7b": ScaleModel(
        "qwen2_5_vl_7b", QWEN2_5_VL_7B,
        {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
         "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656},
        "<|im_end|>", QWEN_TEMPLATE),
    "llava_next_mistral_7b": ScaleModel(
        "llava_next_mistral_7b", LLAVA_NEXT_MISTRAL_7B,
        {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "<image>": 32000},
        "</s>", MISTRAL_TEMPLATE),
}

REDUCED_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2}


def reduced_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same model at CPU-test size: every width and depth shrunk, vocabulary and media settings kept (so a
    request has the same token counts)."""
    c = copy.deepcopy(config)
    c["text_config"].update(REDUCED_TEXT)
    if "mrope_section" in c["text_config"]["rope_parameters"]:
        c["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 3]  # head dim 16
    v = c["vision_config"]
    if c["model_type"] == "qwen2_5_vl":
        v.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                 fullatt_block_indexes=[1])
    else:
        v.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
    return c


def word_tokenizer(vocab_size: int, specials: dict[str, int], eos: str, template: str):
    """A word-level fast tokenizer over the whole vocabulary: id i is the word `w{i}`, except the special tokens at
    their published ids. Text is whitespace-split words; media placeholders stay single tokens for the processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for text, i in specials.items():
        vocab.pop(f"w{i}", None)
        vocab[text] = i
    unk = "<unk>" if "<unk>" in specials else next(iter(specials))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token=unk, chat_template=template,
                                   model_max_length=1 << 20)
    fast.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in (eos, unk)]})
    return fast


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def build_processor(spec: ScaleModel):
    """The family's stock processor at the published image / video settings around `word_tokenizer`. Qwen's video
    processor needs torchvision: without it the processor takes images only (`takes_video` False in `build`)."""
    tok = word_tokenizer(spec.config["text_config"]["vocab_size"], spec.specials, spec.eos, spec.template)
    if spec.config["model_type"] == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

        class ImagesOnly(Qwen2_5_VLProcessor):
            """The stock processor without a video processor (transformers' check cannot run without one)."""

            def check_argument_for_proper_class(self, argument_name, argument):
                return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

        if has_torchvision():
            from transformers import Qwen2VLVideoProcessor

            return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok,
                                       video_processor=Qwen2VLVideoProcessor(), chat_template=spec.template)
        return ImagesOnly(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok, video_processor=None,
                          chat_template=spec.template)
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    c = spec.config
    image = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                       image_grid_pinpoints=c["image_grid_pinpoints"])
    return LlavaNextProcessor(image_processor=image, tokenizer=tok, patch_size=14,
                              vision_feature_select_strategy="default", chat_template=spec.template,
                              image_token="<image>", num_additional_image_tokens=1)


def build_model(config: dict[str, Any], device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                attn: str = "sdpa"):
    """The HF model of `config`, its weights drawn on `device` directly (a 7B model never passes through the CPU),
    eos's output row zeroed so that greedy answers run their full length."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    c = copy.deepcopy(config)
    config_obj = AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config_obj, dtype=dtype, attn_implementation=attn)
    model.eval()
    eos = config_obj.get_text_config().eos_token_id
    with torch.no_grad():
        model.get_output_embeddings().weight[eos].zero_()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = config_obj.get_text_config().pad_token_id
    return model


def build(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, reduced: bool = False,
          seed: int = 0, attn: str = "sdpa") -> VLMTarget:
    """The target adapter (the family's, from the registry) around a real-config model and its processor."""
    from mmspec_ray.targets.registry import wrap

    spec = MODELS[name]
    config = reduced_config(spec.config) if reduced else spec.config
    target = wrap(build_model(config, device, dtype, seed, attn), build_processor(spec))
    if getattr(target.processor, "video_processor", "absent") is None:
        target.takes_video = False  # no torchvision: images only (a clip request is skipped and said so)
    return target


def text_params(target: VLMTarget) -> int:
    """Parameters a decode step reads: the language model and the LM head (not the vision tower)."""
    lm = target.model.get_decoder() if hasattr(target.model, "get_decoder") else target.model
    return sum(p.numel() for p in lm.parameters()) + target.model.get_output_embeddings().weight.numel()


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic photo-sized RGB image (smooth colour fields + noise; its content does not change costs)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / (17 + 3 * c) + seed) + np.cos(y / (23 + 5 * c)) for c in range(3)], -1)
    arr = (base + 2) * 60 + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def words(n: int, seed: int, vocab: int = 30000) -> str:
    """A prompt of n vocabulary words (ids 1000..vocab, clear of every special id)."""
    rng = np.random.default_rng(seed)
    return " ".join(f"w{i}" for i in rng.integers(1000, vocab, n))


# The media requests of the measurement: photo-sized images, and a clip of 16 frames at Kinetics-like size.
IMAGE_SIZE = (1024, 768)
FRAME_SIZE = (640, 480)


def media_request(kind: str, seed: int = 0, prompt_words: int = 24) -> Request:
    """image1: one photo; image4: four photos; clip16: a 16-frame clip (sent as video, or as frames by families
    without video input)."""
    w, h = IMAGE_SIZE
    prompt = words(prompt_words, seed)
    if kind == "image1":
        return Request(prompt=prompt, images=[picture(w, h, seed)])
    if kind == "image4":
        return Request(prompt=prompt, images=[picture(w, h, seed + i) for i in range(4)])
    if kind == "clip16":
        fw, fh = FRAME_SIZE
        return Request(prompt=prompt, videos=[[picture(fw, fh, seed + i) for i in range(16)]])
    raise ValueError(f"unknown media request {kind!r}")
