"""A vision-language model's processor: its tokenizer and image processor, as one object the data
and the saved model use.

    load(cfg)          AutoProcessor's, or where its class cannot be built here, the family's own
                       steps done the same way (`OwnQwenProcessor`)
    VisionProcessor    render a conversation with the chat template, turn text and images into the
                       model's inputs, save the files `from_pretrained` reads back

Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's processor classes need torchvision in this Transformers (their
video processor is built with them), and no CPU torchvision is installable for this torch. Their image
processor has a PIL form, so `OwnQwenProcessor` does what `Qwen2VLProcessor.__call__` does with it:
each image placeholder (`<|image_pad|>`) expanded to grid_t x grid_h x grid_w / merge_size^2 copies,
the text tokenized as the processor tokenizes it, `mm_token_type_ids` 1 on image tokens. From those
and `image_grid_thw` the model computes its 3-D rope positions itself (`get_rope_index`). Qwen3VLProcessor
expands an image the same way (its `replace_image_token`), with Qwen3-VL's 16-pixel patches read from the saved
image processor; an image's deepstack features need nothing more from the data. tests/test_vlm.py checks both
against the processor's own `__call__`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from overdrive.errors import Problem, UserError
from overdrive.hf.vision import QWEN

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

OWN = QWEN  # families whose processor needs torchvision here: done by OwnQwenProcessor


class OwnQwenProcessor:
    """Qwen2-VL's processor steps, with its tokenizer and image processor (the PIL one)."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        # The marks around each image's tokens: the model's own, not the answer's (never in the loss).
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self.chat_template = tokenizer.chat_template

    def __call__(self, text: str, images: list) -> dict:
        import torch

        features: dict = {}
        if images:
            features = dict(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size ** 2
            pieces = text.split(self.image_token)
            if len(pieces) - 1 != len(images):
                raise ValueError(f"{len(pieces) - 1} {self.image_token} placeholders and {len(images)} images")
            counts = [int(grid.prod()) // merge for grid in features["image_grid_thw"]]
            text = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        encoded = self.tokenizer([text], return_tensors="pt")
        types = (encoded["input_ids"] == self.image_token_id).to(torch.long)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                "mm_token_type_ids": types, **features}

    def save_pretrained(self, directory) -> None:
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)


class VisionProcessor:
    """The one face of a processor: AutoProcessor's or OwnQwenProcessor."""

    def __init__(self, processor: Any, own: bool):
        self.processor, self.own = processor, own
        self.tokenizer = processor.tokenizer
        if self.tokenizer.pad_token is None:  # padding is masked; Llama-family tokenizers ship without one
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.chat_template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        self.image_token = getattr(processor, "image_token", None)
        # Tokens that stand for an image (its placeholder, and where a processor names them, the marks around it):
        # never in the loss.
        names = [self.image_token] + [getattr(processor, n, None) for n in ("boi_token", "eoi_token")]
        ids = {self.tokenizer.convert_tokens_to_ids(n) for n in names if isinstance(n, str)}
        for attr in ("vision_start_token_id", "vision_end_token_id", "image_token_id"):
            if isinstance(getattr(processor, attr, None), int):
                ids.add(getattr(processor, attr))
        self.image_token_ids = sorted(i for i in ids if i is not None and i != self.tokenizer.unk_token_id)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.tokenizer.bos_token_id

    def __len__(self) -> int:
        return len(self.tokenizer)

    def render(self, turns: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(turns, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, images: list) -> dict:
        """The model's inputs for one row: sequences of shape (1, tokens), image tensors as the processor gives them."""
        if self.own:
            return self.processor(text, images)
        return dict(self.processor(text=[text], images=images or None, return_tensors="pt"))

    def save_pretrained(self, directory) -> None:
        self.processor.save_pretrained(directory)
        if self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = self.chat_template
            self.tokenizer.save_pretrained(directory)


def load(cfg: RunConfig, model_type: Optional[str]) -> VisionProcessor:
    """The run's processor, from `tokenizer.name_or_path` or the model's directory (or hub name)."""
    m = cfg.model
    name = cfg.tokenizer.name_or_path or m.name_or_path
    key = "tokenizer.name_or_path" if cfg.tokenizer.name_or_path else "model.name_or_path"
    return _with_template(cfg, load_from(name, model_type, key, m.revision, m.trust_remote_code), name)


def load_from(name: str, model_type: Optional[str], key: str, revision: Optional[str] = None,
              trust_remote_code: bool = False) -> VisionProcessor:
    """The processor saved at `name` (a directory or hub name), refused by `key` where none can be built."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from overdrive import hub

    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    with hub.reading(key, name, what="processor", revision=revision):
        if model_type in OWN:
            own = OwnQwenProcessor(AutoTokenizer.from_pretrained(name, **kwargs),
                                   AutoImageProcessor.from_pretrained(name, **kwargs))
            return VisionProcessor(own, own=True)
        try:
            processor = AutoProcessor.from_pretrained(name, **kwargs)
        except (OSError, ValueError, ImportError) as error:
            raise UserError(Problem(key, f"{name}: no processor for a vision-language model could be built "
                                    f"({type(error).__name__}: {str(error).strip()[:200]})",
                                    fix="save the model's processor beside it (processor.save_pretrained), or set "
                                    "tokenizer.name_or_path to a directory that holds one")) from None
    if not hasattr(processor, "image_processor"):
        raise UserError(Problem(key, f"{name}: AutoProcessor gives a {type(processor).__name__}, which has no image "
                                "processor", fix="point it at the vision-language model's own processor files"))
    return VisionProcessor(processor, own=False)


def _with_template(cfg: RunConfig, processor: VisionProcessor, name: str) -> VisionProcessor:
    """`tokenizer.chat_template` over the processor's own; refused by key when there is none."""
    given = cfg.tokenizer.chat_template
    if given:
        from pathlib import Path

        path = Path(given).expanduser()
        processor.chat_template = given if "{" in given else path.read_text() if path.is_file() else None
    if not processor.chat_template:
        raise UserError(Problem("tokenizer.chat_template", f"the processor of {name} has no chat template",
                                fix="set tokenizer.chat_template to a template that renders image parts "
                                "({\"type\": \"image\"}) as the model's image token"))
    return processor
