"""Tiny vision-language models made from configs, no download: `make_tiny_vlm(directory, family)`,
and a task only pixels can answer (`make_colour_data`).

Random weights, a scratch `tokenizers` WordLevel tokenizer wrapped in `PreTrainedTokenizerFast`,
the family's PIL image processor, a short Jinja chat template that takes TRL's content parts
(`{"type": "image"}` / `{"type": "text", "text": ...}`). Saved with `save_pretrained` (model and
processor), so `AutoModelForImageTextToText.from_pretrained(directory)` and
`AutoProcessor.from_pretrained(directory)` load it.

Families: "llava", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl" (the Qwen-VL processors built
without their torchvision video processor: `models.hf.qwen_vl`).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llava", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl")

WORDS = ("What colour is the square ? Describe image a an of this it red green blue yellow "
         "black white answer please shape small big").split()

# The placeholder the *chat template* writes for an image part (what the processor expands).
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>", "idefics3": "<image>",
                "qwen2_vl": _QWEN_IMAGE, "qwen2_5_vl": _QWEN_IMAGE}

_SPECIAL = {
    "llava": ["<image>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}
_SPECIAL["qwen2_5_vl"] = _SPECIAL["qwen2_vl"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '@IMG@' }}"
    "{% else %}{{ ' ' + p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Turns as `<|role|> text <|end|>`; an image part as the family's placeholder; no
`{% generation %}` markers (the assistant span is found by rendering prefixes, as text SFT)."""


def _tokenizer(family: str):  # noqa: ANN202
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    special = base + _SPECIAL[family]
    vocab = {tok: i for i, tok in enumerate(special + list(dict.fromkeys(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Special tokens matched before pre-tokenisation (else `<|user|>` splits into <unk>s).
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    extra: dict = {}
    if family == "gemma3":
        extra["extra_special_tokens"] = {"boi_token": "<start_of_image>",
                                         "eoi_token": "<end_of_image>",
                                         "image_token": "<image_soft_token>"}
    elif family == "llava":
        extra["extra_special_tokens"] = {"image_token": "<image>"}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="<|end|>", **extra)
    fast.chat_template = CHAT_TEMPLATE.replace("@IMG@", _PLACEHOLDER[family])
    return fast


def _text_config(cls, vocab: int, **more):  # noqa: ANN001, ANN202
    return cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=7,
               **more)


def build(family: str):  # noqa: ANN201
    """(model, processor) of ``family`` with random weights (seeded)."""
    import transformers as t

    torch.manual_seed(0)
    tokenizer = _tokenizer(family)
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    template = tokenizer.chat_template
    if family == "llava":
        vision = t.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=28, patch_size=14,
                                    projection_dim=32)
        config = t.LlavaConfig(vision_config=vision,
                               text_config=_text_config(t.LlamaConfig, vocab),
                               image_token_index=ids("<image>"), vision_feature_layer=-1,
                               vision_feature_select_strategy="default",
                               projector_hidden_act="gelu")
        model = t.LlavaForConditionalGeneration(config)
        image_processor = t.CLIPImageProcessorPil(size={"shortest_edge": 28},
                                                  crop_size={"height": 28, "width": 28})
        processor = t.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     patch_size=14, vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1, chat_template=template)
    elif family == "gemma3":
        vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=28, patch_size=14)
        text = _text_config(t.Gemma3TextConfig, vocab, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])
        config = t.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                boi_token_index=ids("<start_of_image>"),
                                eoi_token_index=ids("<end_of_image>"),
                                image_token_index=ids("<image_soft_token>"))
        model = t.Gemma3ForConditionalGeneration(config)
        image_processor = t.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        processor = t.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                      image_seq_length=4, chat_template=template)
    elif family == "idefics3":
        vision = t.Idefics3VisionConfig(hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        image_size=28, patch_size=14)
        config = t.Idefics3Config(vision_config=vision,
                                  text_config=_text_config(t.LlamaConfig, vocab),
                                  scale_factor=2, image_token_id=ids("<image>"))
        model = t.Idefics3ForConditionalGeneration(config)
        image_processor = t.Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": 28},
            max_image_size={"longest_edge": 28})
        processor = t.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                        image_seq_len=1, chat_template=template)
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        model, processor = _qwen_vl(family, tokenizer)
    else:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    if len(processor.tokenizer) != vocab:  # a processor that added tokens (PaliGemma does)
        model.resize_token_embeddings(len(processor.tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


def _qwen_vl(family: str, tokenizer):  # noqa: ANN001, ANN202
    """Qwen2-VL / Qwen2.5-VL: every image resized to 56 x 56 pixels, 16 patches of 14, merged
    2 x 2 into 4 image tokens; M-RoPE over head_dim 8 split 2 + 1 + 1 (time, height, width)."""
    import transformers as t
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from gangtrain.data.qwen_vl_processor import image_only_processor_class

    ids = tokenizer.convert_tokens_to_ids
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 2,
            "eos_token_id": 7, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 1, 1]}}
    tokens = {"image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
              "vision_start_token_id": ids("<|vision_start|>"),
              "vision_end_token_id": ids("<|vision_end|>")}
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4,
                  "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2}
        model = t.Qwen2VLForConditionalGeneration(
            t.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens))
    else:
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                  "out_hidden_size": 32, "patch_size": 14, "spatial_merge_size": 2,
                  "window_size": 56, "fullatt_block_indexes": [1]}
        model = t.Qwen2_5_VLForConditionalGeneration(
            t.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens))
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}, patch_size=14, merge_size=2)
    processor = image_only_processor_class(family)(
        image_processor=image_processor, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template)
    return model, processor


def make_tiny_vlm(directory: str | Path, family: str) -> Path:
    """A tiny ``family`` VLM saved in ``directory`` (model + processor files)."""
    directory = Path(directory)
    model, processor = build(family)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
           "yellow": (230, 230, 20)}
QUESTIONS = ["What colour is the square ?", "Describe the colour of this image please",
             "What colour is it ?"]


def make_colour_data(directory: str | Path, n: int = 16, seed: int = 0, blank: bool = False,
                     name: str = "chat.jsonl", multi_turn_every: int = 5,
                     balanced: bool = False, sizes: tuple[int, ...] = (28, 28, 40)) -> Path:
    """`n` records in TRL's VLM chat format: a square PNG filled with one of 4 colours (28 or
    40 px: the processor resizes), "what colour?" and the colour's name; images under
    `images/`, named relative to the JSONL. `blank`: every image the same grey (the answer
    cannot be seen: chance). Every `multi_turn_every`-th record has a second, text-only turn.
    `balanced`: the colours in turn (each a quarter of the records when 4 divides `n`).
    `sizes`: the image sides drawn from (larger ones cost more to decode and resize)."""
    import json
    import random

    from PIL import Image

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    path = directory / name
    with path.open("w") as f:
        for i in range(n):
            colour = list(COLOURS)[i % 4] if balanced else rng.choice(list(COLOURS))
            file = f"images/{name.split('.')[0]}_{i:04d}.png"
            size = rng.choice(sizes)
            # Grey, not black: Idefics3 drops all-zero (normalised) images as padding.
            fill = (128, 128, 128) if blank else COLOURS[colour]
            Image.new("RGB", (size, size), fill).save(directory / file)
            question = rng.choice(QUESTIONS)
            messages = [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": question}]},
                        {"role": "assistant", "content": [{"type": "text", "text": colour}]}]
            if multi_turn_every and i % multi_turn_every == 0:
                messages += [
                    {"role": "user", "content": [{"type": "text", "text": "Describe it please"}]},
                    {"role": "assistant", "content": [{"type": "text",
                                                       "text": f"a {colour} square"}]}]
            f.write(json.dumps({"messages": messages, "images": [file]}) + "\n")
    return path
