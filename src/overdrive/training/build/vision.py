"""The vision-language step of building a run's parts: the processor and the encoded rows, once
the model's own config says it is one (docs/vision.md).

    settle(cfg)      (the model is a vision-language one, its model_type): read from its Transformers
                     config; what does not compose with one (the table's rows) refused by key here too,
                     for a hub model `explain` could not read offline
    prepare(cfg, model_type, show)   (processor, TokenizedSplits, collator)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def settle(cfg: RunConfig) -> tuple[bool, Optional[str]]:
    from overdrive.hf.model_config import model_config
    from overdrive.hf.vision import FAMILIES, is_vision_config
    from overdrive.resolving import composition

    config = model_config(cfg)
    vision = is_vision_config(config)
    if cfg.model.vision.enabled is False:
        if vision:  # its class is chosen by its config: training it as a text model is not done here
            raise UserError(Problem("model.vision.enabled", f"is false, but {cfg.model.name_or_path}'s config "
                                    f"({type(config).__name__}) has a vision tower", fix="unset model.vision.enabled"))
        return False, None
    if cfg.model.vision.enabled and not vision:
        raise UserError(Problem("model.vision.enabled", f"{cfg.model.name_or_path}'s config ({type(config).__name__})"
                                " has no vision tower", fix="unset model.vision.enabled, or point "
                                "model.name_or_path at a vision-language model"))
    if not vision:
        return False, None
    found = composition.problems(cfg, vision=True)
    if config.model_type not in FAMILIES:
        found.append(Problem("model.vision.enabled", f"{config.model_type}: vision-language training is checked here "
                             f"for {', '.join(FAMILIES)}; this family's processor outputs are not yet",
                             fix="use one of those families, or fine-tune it with a TRL script under "
                             "`overdrive launch`"))
    if found:
        raise UserError(found)
    return True, config.model_type


def prepare(cfg: RunConfig, model_type: Optional[str], show: bool = False):
    """The processor, the encoded rows (conversations, or preference pairs) and their collator."""
    from overdrive.data import vision_pairs
    from overdrive.data.vision_samples import VisionCollator, prepare as encoded_rows
    from overdrive.hf.vision_processor import load

    processor = load(cfg, model_type)
    if cfg.preference.method != "none":
        return processor, vision_pairs.prepare(cfg, processor, show), vision_pairs.VisionPairCollator(
            processor.pad_token_id)
    rope = None
    if cfg.data.packing:  # each packed conversation's 3-D positions, by the model's own rule (hf/vision.py)
        from overdrive.hf.model_config import model_config
        from overdrive.hf.vision import rope_index

        rope = rope_index(model_config(cfg))
    return processor, encoded_rows(cfg, processor, show=show, rope=rope), VisionCollator(processor.pad_token_id)


def prompts(cfg: RunConfig, model_type: Optional[str]):
    """GRPO's prompts with images (data/vision_prompts.py) and their completion slots, as grpo_parts.prepare gives
    a text run's: (the processor's tokenizer, PromptData)."""
    from overdrive.data import prompts as prompts_mod, vision_prompts
    from overdrive.hf.vision_processor import load
    from overdrive.training.build.grpo_parts import PromptData

    processor = load(cfg, model_type)
    prompt_set = vision_prompts.encode(cfg, processor)
    layout = prompts_mod.slot_layout(cfg, len(prompt_set.rows))
    return processor.tokenizer, PromptData(prompt_set, layout, prompts_mod.Slots(layout))


def notes(cfg: RunConfig, model) -> list[str]:
    """What the run says it trains of a vision-language model."""
    from overdrive.hf.vision import part_of

    sizes: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        counts = sizes.setdefault(part_of(name.replace("base_model.model.", "", 1)), [0, 0])
        counts[0] += param.numel()
        counts[1] += param.numel() if param.requires_grad else 0
    said = ", ".join(f"{part} {trained:,} of {total:,} trained" for part, (total, trained) in sorted(sizes.items()))
    built = getattr(model, "get_base_model", lambda: model)()  # an adapter run: the model under PEFT's wrapper
    return [f"vision-language model ({type(built).__name__}): {said}"]
