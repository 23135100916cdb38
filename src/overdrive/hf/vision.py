"""Vision-language models as Transformers builds them: which configs are one, and which of a
model's modules are its vision tower, its projector and its language model.

    declared(cfg)            whether the run's model is a vision-language one, from `model.vision.enabled`
                             or the model's config.json, read without Transformers (explain stays light)
    family(cfg)              its model_type, where the config can be read
    part_of(name)            `vision`, `projector` or `language` for a module or parameter name
    frozen_parts_pattern(v)  a regular expression over module names that PEFT leaves out (`exclude_modules`)

The processor (tokenizer and image processor together): hf/vision_processor.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from overdrive.errors import Problem

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig
    from overdrive.config.schema_vision import VisionConfig

# The names Transformers gives a vision-language model's parts (its modeling files: Qwen2-VL's `visual` with
# its `merger`, and Qwen3-VL's with its `deepstack_merger_list` too (mergers of earlier blocks' features, added to
# the language model's first layers), LLaVA's `vision_tower` and `multi_modal_projector`, Idefics3's
# `vision_model` and `connector`).
VISION_TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTORS = ("multi_modal_projector", "merger", "deepstack_merger_list", "connector", "mm_projector")
# The Qwen-VL families: 3-D rope positions, a processor class that needs torchvision here (hf/vision_processor.py).
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# The families trained and checked here (tests/test_vlm.py); another is refused by model.vision.enabled
# until its processor's outputs are checked against the collator (Idefics3 pads images per row, Gemma 3
# attends bidirectionally over image tokens through token_type_ids, ...).
# (Qwen3-VL-MoE shares Qwen3-VL's processor and positions, but its MoE language model is not checked yet.)
FAMILIES = (*QWEN, "llava")


def _config_json(name_or_path: str, revision: Optional[str]) -> Optional[dict]:
    """The model's config.json: a local directory's, or a hub model's copy already in the local cache
    (nothing is downloaded: `explain` of a config meant for another machine stays offline)."""
    path = Path(name_or_path).expanduser()
    file: Optional[Path] = path / "config.json" if path.is_dir() else None
    if file is None and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        except Exception:  # a name the hub would refuse: the model's own read says so, by key
            found = None
        file = Path(found) if isinstance(found, str) else None
    if file is None or not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def config_is_vision(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict)


def is_vision_config(config) -> bool:
    """A Transformers config (or its dict) with a vision tower."""
    if isinstance(config, dict):
        return config_is_vision(config)
    return getattr(config, "vision_config", None) is not None


def declared(cfg: RunConfig) -> bool:
    """Whether the run trains a vision-language model: `model.vision.enabled`, else its config.json."""
    m = cfg.model
    if m.vision.enabled is not None:
        return m.vision.enabled
    if not m.name_or_path:
        return config_is_vision(m.architecture)
    config = _config_json(m.name_or_path, m.revision)
    return config is not None and config_is_vision(config)


def known_text(cfg: RunConfig) -> bool:
    """Whether the run's model is known to have no vision tower (False where its config cannot be read here)."""
    m = cfg.model
    if m.vision.enabled is not None:
        return not m.vision.enabled
    config = _config_json(m.name_or_path, m.revision) if m.name_or_path else m.architecture
    return config is not None and not config_is_vision(config)


def family(cfg: RunConfig) -> Optional[str]:
    """The model_type of the run's vision-language model, where its config can be read."""
    m = cfg.model
    config = _config_json(m.name_or_path, m.revision) if m.name_or_path else m.architecture
    return (config or {}).get("model_type")


def describe(cfg: RunConfig) -> dict:
    """How the run's model is built, as `explain` says it: the Auto class, and for a vision-language model
    its processor and the parts that train."""
    if not declared(cfg):
        auto = "AutoModelForSequenceClassification" if cfg.model.task == "sequence-classification" else \
            "AutoModelForCausalLM"
        return {"auto_class": auto, "vision": False, "text": f"built with {auto}"}
    kind = family(cfg)
    own = kind in QWEN  # hf/vision_processor.OWN: its class needs torchvision here
    processor = ("its tokenizer and image processor, as its processor class does it" if own
                 else "AutoProcessor")
    trains = sorted(trained_parts(cfg.model.vision))
    return {"auto_class": "AutoModelForImageTextToText", "vision": True, "family": kind, "processor": processor,
            "trains": trains, "text": f"vision-language ({kind or 'family read when it loads'}): built with "
            f"AutoModelForImageTextToText, images through {processor}; trains the {', '.join(trains)} "
            f"part{'s' if len(trains) > 1 else ''}{' (by LoRA)' if cfg.peft.method != 'none' else ''}"}


def part_of(name: str) -> str:
    """`projector`, `vision` or `language`: where a module or parameter sits. Qwen2-VL's merger (and Qwen3-VL's
    deepstack mergers) live inside its `visual` tower and are the projector."""
    parts = name.split(".")
    if any(p in PROJECTORS for p in parts):
        return "projector"
    if any(p in VISION_TOWERS for p in parts):
        return "vision"
    return "language"


def trained_parts(vision: VisionConfig) -> set[str]:
    return {"language"} | ({"vision"} if not vision.freeze else set()) | ({"projector"} if vision.train_projector
                                                                          else set())


def frozen_parts_pattern(vision: VisionConfig) -> Optional[str]:
    """A regular expression PEFT full-matches against module names (`exclude_modules`): the parts left
    frozen, so `all-linear` (or a name such as q_proj, which CLIP's vision tower also has) targets the
    language model, and the projector or vision tower only when asked."""
    projector = r"(?:.*\.)?(?:" + "|".join(PROJECTORS) + r")(?:\..*)?"
    tower = (r"(?!(?:.*\.)?(?:" + "|".join(PROJECTORS) + r")(?:\.|$))(?:.*\.)?(?:" + "|".join(VISION_TOWERS)
             + r")(?:\..*)?")
    trained = trained_parts(vision)
    alternatives = [p for part, p in (("projector", projector), ("vision", tower)) if part not in trained]
    return "|".join(f"(?:{p})" for p in alternatives) or None


def freeze(model, vision: VisionConfig) -> dict[str, int]:
    """The vision tower and projector frozen unless `model.vision.*` trains them (no adapter: the
    language model trains in full). Returns the parameters of each part, for the run's note."""
    trained, sizes = trained_parts(vision), {"vision": 0, "projector": 0, "language": 0}
    for name, param in model.named_parameters():
        part = part_of(name)
        sizes[part] += param.numel()
        if part not in trained:
            param.requires_grad_(False)
    return sizes


def rope_index(config):
    """A callable (input_ids (1, s), mm_token_type_ids (1, s), image_grid_thw) -> the 3-D rope positions (3, s)
    of one row, by the model's own `get_rope_index`, for a family whose positions are 3-D (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL: its images advance the text positions by their larger side rather than Qwen2-VL's largest grid side);
    None for one whose positions are a row's token indices (LLaVA). The method reads the config alone, so it is
    called on an instance holding only that (no weights are built)."""
    if config.model_type not in QWEN:
        return None
    from transformers import AutoModel

    holder = object.__new__(AutoModel._model_mapping[type(config)])  # Qwen2VLModel: its methods, not its weights
    holder.__dict__["config"] = config

    def positions(input_ids, mm_token_type_ids, image_grid_thw):
        return holder.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)[0][:, 0, :]

    return positions


def unopened_image(source: Any, what: str, place: str) -> Optional[Problem]:
    """An image file PIL cannot identify (text, an empty or cut file, another format) by its header alone:
    found before launch, not when the run has encoded every row before it."""
    from PIL import Image

    try:
        with Image.open(source):
            return None
    except (OSError, ValueError) as error:  # PIL's UnidentifiedImageError is an OSError
        return Problem("data.images_column", f"{place}: {what} does not open as an image: {error}", place,
                       "replace or drop the image")
