"""A tiny random-init Mistral3 (`Mistral3ForConditionalGeneration`) model + processor, built in-process for tests (no
downloads).

Vision: a 1-layer Pixtral tower of 8 px patches, merged 2x2 by the patch merger, so one image token per 16 px
cell. Images are resized to a longest edge of 64 px and each side rounded up to the 16 px cell: a 96x96 image
becomes 4x4 cells (16 `[IMG]`, 3 `[IMG_BREAK]`, 1 `[IMG_END]`), the 96x60 one 3 rows x 4 (12 + 2 + 1).

Processor: transformers' `PixtralProcessor` cannot be imported without torchvision (its module imports the
torchvision image processor at the top; the PIL one, `PixtralImageProcessorPil`, needs none). `TinyPixtralProcessor`
is its stand-in: the same constructor arguments and the same public `ProcessorMixin` hooks (the image processor
resizes on `patch_size * spatial_merge_size` cells; each `[IMG]` becomes the rows of `[IMG]`, `[IMG_BREAK]`,
`[IMG_END]`), mirroring the stock class.
"""

from __future__ import annotations

from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessorPil,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)

from tiny import ready, seeded_model, tiny_fast_tokenizer

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
INST, END_INST = "[INST]", "[/INST]"
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"

PATCH = 8
MERGE = 2
CELL = PATCH * MERGE  # pixels per image token side
LONGEST_EDGE = 64

# Mistral style: "<s>[INST]<media parts><text>[/INST]"; an image part is rendered as [IMG], which the processor
# expands into the image's rows.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '[INST]' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '[IMG]' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{- '[/INST]' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


class TinyPixtralProcessor(ProcessorMixin):
    """`PixtralProcessor`'s behaviour without its torchvision import (see the module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, patch_size: int = 16, spatial_merge_size: int = 1,
                 chat_template: str | None = None, image_token: str = IMG, image_break_token: str = IMG_BREAK,
                 image_end_token: str = IMG_END, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
        self.image_token, self.image_break_token, self.image_end_token = image_token, image_break_token, image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.image_break_token_id = tokenizer.convert_tokens_to_ids(image_break_token)
        self.image_end_token_id = tokenizer.convert_tokens_to_ids(image_end_token)

    @property
    def image_token_ids(self) -> list[int]:
        return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

    def _process_images(self, images, **images_kwargs):
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size  # resize on whole merged cells
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """Rows of `[IMG] * cols + [IMG_BREAK]`, the last break replaced by `[IMG_END]`."""
        cell = self.patch_size * self.spatial_merge_size
        height, width = image_inputs["image_sizes"][image_idx]
        rows = [self.image_token * (int(width) // cell) + self.image_break_token] * (int(height) // cell)
        return "".join(rows)[: -len(self.image_break_token)] + self.image_end_token

    @property
    def model_input_names(self) -> list[str]:
        return self.tokenizer.model_input_names + self.image_processor.model_input_names + ["image_sizes"]


def mistral3_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the shared tiny BPE (never mutate the cached one) with Mistral3's special tokens."""
    return tiny_fast_tokenizer([BOS, EOS, PAD, INST, END_INST, IMG, IMG_BREAK, IMG_END], bos_token=BOS,
                               eos_token=EOS, pad_token=PAD, extra_special_tokens={"image_token": IMG},
                               chat_template=CHAT_TEMPLATE)


def build_processor(tok: PreTrainedTokenizerFast) -> TinyPixtralProcessor:
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                               patch_size={"height": PATCH, "width": PATCH})
    return TinyPixtralProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                                spatial_merge_size=MERGE, chat_template=CHAT_TEMPLATE)


def tiny_mistral3(seed: int = 0, init: float = 0.2, num_hidden_layers: int = 2):
    """(model, processor) for a 64-wide Mistral decoder of `num_hidden_layers` layers (no sliding window, as the
    released checkpoints) behind a 1-layer Pixtral tower and a 2x2 patch merger; untied head."""
    tok = mistral3_tokenizer()
    processor = build_processor(tok)
    ids = tok.convert_tokens_to_ids
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=LONGEST_EDGE, patch_size=PATCH, initializer_range=init)
    text = MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=None,
        eos_token_id=ids(EOS), pad_token_id=ids(PAD), bos_token_id=ids(BOS), tie_word_embeddings=False,
        initializer_range=init,
    )
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=ids(IMG),
                            spatial_merge_size=MERGE, tie_word_embeddings=False)
    config.initializer_range = init  # the composite model's _init_weights reads the top-level config
    model = seeded_model(Mistral3ForConditionalGeneration, config, seed)
    return ready(model, tok), processor
