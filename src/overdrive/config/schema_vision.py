"""`model.vision.*`: how a vision-language model (a model whose config has a vision tower:
Qwen2-VL, Qwen2.5-VL, LLaVA, ...) is trained. docs/vision.md."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from overdrive.config.sections import Section


class VisionConfig(Section):
    """A vision-language model's parts: which of them train."""

    enabled: Optional[bool] = Field(
        None, description="Train the model as a vision-language model (built with AutoModelForImageTextToText and "
        "its processor; rows carry images). Empty: by the model's config (a `vision_config` in a local "
        "directory's config.json, or a hub model's cached one); `true` for a hub model not read yet. `false` on a model "
        "with a vision tower is refused when the run starts."
    )
    freeze: bool = Field(
        True, description="Keep the vision tower's weights as they are. `false`: train them too (in full, or "
        "with LoRA on its linear layers when `peft.method` is set)."
    )
    train_projector: bool = Field(
        False, description="Train the projector that maps image features into the language model (LLaVA's "
        "multi_modal_projector, Qwen2-VL's merger): in full, or with LoRA on its linear layers under "
        "`peft.method`. Off: frozen, as the vision tower."
    )
