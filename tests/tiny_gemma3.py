"""A tiny random-init Gemma3 (Gemma3ForConditionalGeneration) model + processor, built in-process (no downloads).

Vision: a 1-layer SigLIP tower on 64 px images of 8 px patches (64 patches), average-pooled to 16 soft tokens.
Text: 2 layers, layer 0 sliding-window (window `SLIDING_WINDOW`, far shorter than the prompts and trees used in
tests, so the window really cuts attention), layer 1 global. `final_logit_softcapping` is set so a test can see
whether the model applies it (Gemma3ForConditionalGeneration does not; the adapter must agree).
All weights use the large `init` std except the tied token embedding (`EMBED_STD`, see below).
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from tiny import mute_eos, seeded_model, tiny_fast_tokenizer

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SOT, EOT = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

IMAGE_SIZE = 64
PATCH = 8
TOKENS_PER_IMAGE = 16  # 8x8 patches pooled 2x2
SLIDING_WINDOW = 6
EMBED_STD = 0.02  # tied token embedding (scaled by sqrt(64) = 8 on input); see tiny_gemma3
LOGIT_SOFTCAP = 0.25  # below this model's logit range (~0.7), so capping would be visible if the model applied it

# Gemma style: "<bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n"; an image part is rendered as
# <start_of_image>, which the processor expands to "\n\n<start_of_image><image_soft_token>*16<end_of_image>\n\n".
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def gemma3_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the shared tiny BPE (never mutate the cached one) with Gemma3's special tokens."""
    return tiny_fast_tokenizer([BOS, EOS, PAD, SOT, EOT, BOI, EOI, IMAGE], bos_token=BOS, eos_token=EOS,
                               pad_token=PAD, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI,
                                                                    "image_token": IMAGE},
                               chat_template=CHAT_TEMPLATE)


def build_processor(tok: PreTrainedTokenizerFast) -> Gemma3Processor:
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                           image_seq_length=TOKENS_PER_IMAGE)


def tiny_gemma3(seed: int = 0, init: float = 0.5):
    """(model, processor) for a 2-layer, 64-wide Gemma3 decoder (sliding + global layer) with a tiny SigLIP tower."""
    tok = gemma3_tokenizer()
    processor = build_processor(tok)
    ids = tok.convert_tokens_to_ids
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=4096,
        sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=LOGIT_SOFTCAP,
        eos_token_id=[ids(EOS), ids(EOT)], pad_token_id=ids(PAD), bos_token_id=ids(BOS), initializer_range=init,
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=ids(BOI), eoi_token_index=ids(EOI), image_token_index=ids(IMAGE),
                          initializer_range=init)
    model = seeded_model(Gemma3ForConditionalGeneration, config, seed)
    with torch.no_grad():
        # Gemma3 zero-inits the image projection, which would make every image look the same.
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, init)
        # The embedding is tied to lm_head and scaled by sqrt(hidden) on input: at std `init` the input embedding
        # dominates the residual stream and greedy decoding repeats its input token forever; keep it small.
        model.model.language_model.embed_tokens.weight.normal_(0.0, EMBED_STD)
    for eos in text.eos_token_id:
        mute_eos(model, eos)
    return model.eval(), processor
