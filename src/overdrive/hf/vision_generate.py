"""`overdrive generate` on a vision-language model (or an adapter on one): the question asked about the
images given with `--image`, through the model's processor and chat template, as its training rows were.

    load(target, base, dtype, device)    the model (AutoModelForImageTextToText, with its adapter) and its
                                         processor; None when `target` is not a vision-language model
    generated_ids(loaded, prompt, images, sampling, streamer)   the answer's new token ids
    answers(model, processor, rows, sampling)   a run's sample answers (`eval.prompts`, each with its images)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from overdrive.errors import Problem, UserError
from overdrive.hf.saved_model import KEY, _dtype, adapter_base, is_adapter, model_path


@dataclass
class LoadedVision:
    model: Any
    processor: Any  # hf/vision_processor.VisionProcessor
    what: str

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def _config(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def load(target: str, base: Optional[str], dtype: str, device: Optional[str]) -> Optional[LoadedVision]:
    """The vision-language model at `target` with its processor (from beside the weights, or the adapter's base);
    None when `target` is a text model (or not read here: hub names load as text models do)."""
    import transformers

    from overdrive import hub
    from overdrive.hf.vision import config_is_vision
    from overdrive.hf.vision_processor import load_from

    path = Path(model_path(target)).expanduser()
    adapter = path.is_dir() and is_adapter(path)
    base_name = adapter_base(path, base)[0] if adapter else str(path)
    config = _config(Path(base_name).expanduser())
    if not path.is_dir() or config is None or not config_is_vision(config):
        return None
    transformers.utils.logging.disable_progress_bar()
    with hub.reading(KEY, base_name):
        model = transformers.AutoModelForImageTextToText.from_pretrained(base_name, dtype=_dtype(dtype))
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(path))
    saved_here = (path / "tokenizer_config.json").is_file()
    processor = load_from(str(path) if saved_here else base_name, config.get("model_type"), KEY)
    if device:
        model.to(device)
    model.eval()
    return LoadedVision(model, processor, f"{path} (adapter on {base_name})" if adapter else str(path))


def open_images(paths: list[str], key: str = "--image") -> list:
    """Each `--image` (or `key`'s image) as an RGB PIL image, refused by `key` naming the file."""
    from PIL import Image

    images = []
    for name in paths:
        file = Path(name).expanduser()
        if name.startswith(("http://", "https://")) or not file.is_file():
            raise UserError(Problem(key, f"no image file {name}", fix="give the path of an image on this machine"))
        try:
            with Image.open(file) as opened:
                images.append(opened.convert("RGB"))
        except OSError as error:
            raise UserError(Problem(key, f"{name} does not open as an image: {error}",
                                    fix="give a PNG, JPEG or another image PIL reads")) from None
    return images


def generated_ids(loaded: LoadedVision, prompt: str, images: list, sampling: Any, streamer: Any = None) -> list[int]:
    """The new token ids the model answers with: one user turn, the images first and then the question."""
    import torch

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = loaded.processor.render([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = loaded.processor.encode(text, images)
    device = next(loaded.model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    tokenizer = loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = loaded.model.generate(**inputs, pad_token_id=pad, streamer=streamer, **sampling.generate_kwargs())
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def answers(model: Any, processor: Any, rows: list, sampling: Any) -> list[str]:
    """Each `eval.prompts` row (hf/generation.PromptRow) answered about its images as `overdrive generate --image`
    answers: the model as it trains (put back in training mode after), `processor` the run's VisionProcessor."""
    import torch

    loaded = LoadedVision(model, processor, "")
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    was_training = model.training
    model.eval()
    try:
        return [loaded.tokenizer.decode(generated_ids(loaded, row.text, open_images(list(row.images), "eval.prompts"),
                                                      sampling), skip_special_tokens=True) for row in rows]
    finally:
        model.train(was_training)
