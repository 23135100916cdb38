"""How many tokens an image becomes, read from the processor's saved files and the model's config,
without loading either (the estimator and `plan` stay offline and light).

    image_tokens(cfg)     (tokens of one image in the language model's sequence, patches the vision tower
                          sees for it, how it was read): Qwen2-VL's and Qwen3-VL's at the image processor's
                          largest size (max_pixels / patch^2 / merge^2), LLaVA's (image_size / patch)^2 less
                          the CLS token its "default" feature strategy drops

The image tokens are part of `data.max_length` (a row's length counts them: docs/vision.md); these
figures size what the vision tower holds and say how much of each row an image takes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from overdrive.hf.vision import QWEN

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def _saved(name_or_path: str, file: str, revision: Optional[str]) -> dict:
    """A json file saved beside the model: a local directory's, or the hub cache's copy (nothing downloaded)."""
    path = Path(name_or_path).expanduser()
    found: Optional[Path] = path / file if path.is_dir() else None
    if found is None and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, file, revision=revision)
        except Exception:  # a name the hub refuses: nothing to read
            cached = None
        found = Path(cached) if isinstance(cached, str) else None
    if found is None or not found.is_file():
        return {}
    try:
        data = json.loads(found.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _qwen(config, image: dict) -> tuple[int, int, str]:
    vision = config.vision_config
    patch = int(image.get("patch_size") or getattr(vision, "patch_size", None) or 14)
    merge = int(image.get("merge_size") or getattr(vision, "spatial_merge_size", None) or 2)
    size = image.get("size") or {}
    pixels = int(image.get("max_pixels") or size.get("longest_edge") or 12845056)  # the processor's default
    side = patch * merge  # the image is resized to multiples of this, within max_pixels
    units = max(pixels // (side * side), 1)
    return units, units * merge * merge, (f"at most {pixels:,} pixels an image (max_pixels), {patch}-pixel patches "
                                          f"merged {merge}x{merge}")


def _llava(config, processor: dict) -> tuple[int, int, str]:
    vision = config.vision_config
    patch = int(processor.get("patch_size") or getattr(vision, "patch_size", None) or 14)
    image = processor.get("image_processor") or {}
    crop = image.get("crop_size") or {}
    side = int(crop.get("height") or getattr(vision, "image_size", None) or 336)
    grid = (side // patch) ** 2
    extra = int(processor.get("num_additional_image_tokens", 1))  # CLIP's CLS token
    strategy = processor.get("vision_feature_select_strategy") or getattr(config, "vision_feature_select_strategy",
                                                                          "default")
    tokens = grid + extra - (1 if strategy == "default" else 0)
    return tokens, grid + extra, f"{side}x{side} images, {patch}-pixel patches ({strategy} features)"


def image_tokens(config, processor_at: Optional[str], revision: Optional[str] = None) -> tuple[int, int, str]:
    """(tokens one image takes in a row, patches the vision tower runs over for it, the basis) for a model
    `config` whose processor files are saved at `processor_at` (a directory or hub name; None: the
    processor's defaults); (0, 0, why) where the family's sizes are not read here."""
    kind = getattr(config, "model_type", None)
    if kind in QWEN:
        return _qwen(config, _saved(processor_at, "preprocessor_config.json", revision) if processor_at else {})
    if kind == "llava":
        return _llava(config, _saved(processor_at, "processor_config.json", revision) if processor_at else {})
    return 0, 0, f"{kind}: image sizes not read for this family"


def of_run(cfg: RunConfig, config) -> tuple[int, int, str]:
    """`image_tokens` of a run's model, its processor read where the run reads it."""
    return image_tokens(config, cfg.tokenizer.name_or_path or cfg.model.name_or_path, cfg.model.revision)
