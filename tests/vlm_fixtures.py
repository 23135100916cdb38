"""Tiny vision-language models built from their Transformers configs (random weights, saved with
save_pretrained), a word-level tokenizer with a chat template that renders image parts, and a data
set of coloured images whose answer is the colour: what tests/test_vlm.py trains."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
           "<image>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
WORDS = ["user", "assistant", "system", "what", "colour", "is", "it", "the", "answer", "a", "b", "c", *COLOURS]


def _template(image: str) -> str:
    """A ChatML template whose image parts render as `image` (the model's placeholder)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image + "{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(image: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(SPECIAL + WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL)
    tok.chat_template = _template(image)
    return tok


def _save_qwen(directory: Path, seed: int, classes: tuple, text: dict, vision: dict, image_processor) -> Path:
    """A Qwen-VL model of `classes` (config, model) with the word-level tokenizer, its image token <|image_pad|>
    between <|vision_start|> and <|vision_end|>, saved with `image_processor`."""
    import torch

    tok = tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIAL}
    text = {**text, "vocab_size": len(tok), "max_position_embeddings": 512, "pad_token_id": 0,
            "eos_token_id": ids["<|im_end|>"], "bos_token_id": None}
    config_class, model_class = classes
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], pad_token_id=0, eos_token_id=ids["<|im_end|>"])
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    image_processor.save_pretrained(directory)
    return directory


def make_tiny_qwen2_vl(directory: Path, seed: int = 0, family: str = "qwen2_vl") -> Path:
    """A 2-layer Qwen2-VL (or Qwen2.5-VL) language model (hidden 32) with a 1-block vision tower (patch 14,
    merge 2), its PIL image processor limited to small images."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_5_vl":
        vision = dict(depth=1, hidden_size=16, out_hidden_size=32, intermediate_size=32, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                      fullatt_block_indexes=[0])
    classes = ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if family == "qwen2_5_vl"
               else (Qwen2VLConfig, Qwen2VLForConditionalGeneration))
    return _save_qwen(directory, seed, classes, text, vision,
                      Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56))


def make_tiny_qwen3_vl(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-VL language model (hidden 32) with a 2-block vision tower (patch 16, merge 2) whose first
    block also feeds a deepstack merger (its features added to the language model's first layer), its PIL image
    processor (Qwen2-VL's class, as AutoImageProcessor picks for Qwen3-VL, with its 16-pixel patches) limited to
    64x64 images: 4 image tokens."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                        "mrope_interleaved": True, "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    image = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64,
                                     max_pixels=64 * 64, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return _save_qwen(directory, seed, (Qwen3VLConfig, Qwen3VLForConditionalGeneration), text, vision, image)


def make_tiny_llava(directory: Path, seed: int = 0) -> Path:
    """LLaVA: a 1-layer CLIP vision tower (28-pixel images, patch 14: 4 patches and CLIP's CLS token, all 5 kept
    by the "full" feature strategy: 5 image tokens) and a 2-layer Llama,
    with LlavaProcessor (CLIP's PIL image processor) saved beside them."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tokenizer("<image>")
    image = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=14, image_token="<image>",
                               vision_feature_select_strategy="full", num_additional_image_tokens=1,
                               chat_template=tok.chat_template)
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=28, patch_size=14),
                         text_config=LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                                 max_position_embeddings=256, pad_token_id=0,
                                                 eos_token_id=tok.eos_token_id, bos_token_id=None),
                         image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                         vision_feature_select_strategy="full")
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def processor_class_of(directory: Path):
    """The model's own processor class: AutoProcessor where it builds; Qwen2-VL's Qwen2VLProcessor (Qwen3-VL's
    Qwen3VLProcessor) without the video processor it cannot build without torchvision (its tokenizer and PIL image
    processor as it holds them)."""
    import importlib.util

    import transformers

    from overdrive.hf.vision import QWEN

    config = json.loads((Path(directory) / "config.json").read_text())
    if config["model_type"] not in QWEN or importlib.util.find_spec("torchvision"):
        return transformers.AutoProcessor.from_pretrained(directory)
    processor = object.__new__(transformers.Qwen3VLProcessor if config["model_type"] == "qwen3_vl"
                               else transformers.Qwen2VLProcessor)
    processor.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    processor.image_processor = transformers.AutoImageProcessor.from_pretrained(directory)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    processor.chat_template = processor.tokenizer.chat_template
    return processor


def make_images(directory: Path, rows: int, seed: int = 0, size: int = 56) -> list[tuple[str, str]]:
    """(relative path, colour) of `rows` PNG images of one colour each, with noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(rows):
        colour = list(COLOURS)[i % len(COLOURS)]
        pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 20, (size, size, 3)), 0, 255).astype("uint8")
        Image.fromarray(pixels).save(directory / "images" / f"{i}.png")
        made.append((f"images/{i}.png", colour))
    return made


def make_vision_data(directory: Path, rows: int = 24, layout: str = "messages", seed: int = 0,
                     size: int = 56) -> Path:
    """Rows asking the colour of an image: TRL's layout (`messages` with image parts, `images`), or
    LLaMA-Factory's ShareGPT or Alpaca (`<image>` in the text, `images`). Written to directory/<layout>.jsonl."""
    made = make_images(directory, rows, seed, size)
    rng = random.Random(seed)
    path = directory / f"{layout}.jsonl"
    with open(path, "w") as f:
        for image, colour in made:
            question = "what colour is it " + rng.choice("abc")
            if layout == "messages":
                row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": f"the answer is {colour}"}]}]}
            elif layout == "sharegpt":
                row = {"conversations": [{"from": "human", "value": "<image>" + question},
                                         {"from": "gpt", "value": f"the answer is {colour}"}]}
            else:
                row = {"instruction": "<image>" + question, "input": "", "output": f"the answer is {colour}"}
            f.write(json.dumps({**row, "images": [image]}) + "\n")
    return path


def make_vision_pairs(directory: Path, rows: int = 16, seed: int = 0, size: int = 56) -> Path:
    """TRL's vision preference pairs: `images`, a `prompt` of turns with an image part, `chosen` the image's
    colour and `rejected` another. Written to directory/pairs.jsonl."""
    made = make_images(directory, rows, seed, size)
    path = directory / "pairs.jsonl"
    with open(path, "w") as f:
        for i, (image, colour) in enumerate(made):
            wrong = [c for c in COLOURS if c != colour][i % 2]
            row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it"}]}],
                   "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"the answer is {colour}"}]}],
                   "rejected": f"the answer is {wrong}", "images": [image]}
            f.write(json.dumps(row) + "\n")
    return path


def make_vision_prompts(directory: Path, rows: int = 12, seed: int = 0, size: int = 56) -> Path:
    """Prompts with images for GRPO: a prompt of turns with an image part, `images`, and the image's `colour`
    (a column the rewards receive). Written to directory/prompts.jsonl."""
    made = make_images(directory, rows, seed, size)
    path = directory / "prompts.jsonl"
    with open(path, "w") as f:
        for image, colour in made:
            row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it"}]}],
                   "images": [image], "colour": colour}
            f.write(json.dumps(row) + "\n")
    return path


def make_tiny_models(root: Path) -> Path:
    """A tiny Qwen2-VL (root/qwen) and a tiny LLaVA (root/llava), seed 0: what most of the vision tests train."""
    make_tiny_qwen2_vl(root / "qwen")
    make_tiny_llava(root / "llava")
    return root


def answer_accuracy(model_dir: Path, data_file: Path, limit: int = 0) -> float:
    """The share of `data_file`'s rows (TRL's layout) whose greedy answer, asked about the row's image by the
    model (or adapter) saved at `model_dir`, names the row's colour and no other."""
    import torch
    from PIL import Image

    from overdrive.hf.vision_generate import load

    loaded = load(str(model_dir), None, "float32", None)
    rows = [json.loads(line) for line in Path(data_file).read_text().splitlines()][:limit or None]
    right = 0
    for row in rows:
        turns = row["messages"]
        colour = next(c for c in COLOURS if c in turns[1]["content"][0]["text"])
        image = Image.open(Path(data_file).parent / row["images"][0]).convert("RGB")
        text = loaded.processor.render(turns[:1], add_generation_prompt=True)
        inputs = {k: v for k, v in loaded.processor.encode(text, [image]).items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            out = loaded.model.generate(**inputs, do_sample=False, max_new_tokens=6,
                                        pad_token_id=loaded.tokenizer.pad_token_id)
        answer = loaded.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split()
        right += [w for w in answer if w in COLOURS] == [colour]
    return right / len(rows)
