"""Prompts with images for GRPO on a vision-language model (`rl.method: grpo`, `data.format: prompts`): each
row's prompt (text with `<image>`, or turns with {"type": "image"} parts) and its `images` column, rendered
with the generation prompt and encoded by the processor; the completions are text (docs/vision.md).

    encode(cfg, processor)       a VisionPromptSet: PromptSet's rows, prompts and ids, and each prompt's image
                                 inputs (pixel values, image grids, image-token types)
    image_inputs(prompts, rows, prompt_width, completion_width, device)
                                 the image inputs of a batch of prompts left-padded to `prompt_width` and followed
                                 by `completion_width` completion tokens: what the policy's generate and its
                                 forwards over the completions read beside the token ids
    problems(cfg, rows)          every row's images against its image parts, before the model loads
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from overdrive.data import vision_rows
from overdrive.data.prompts import PromptSet
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes")  # per image, concatenated in row order


@dataclass
class VisionPromptSet(PromptSet):
    images: list[dict] = field(default_factory=list)  # per row: IMAGE_INPUTS, and Qwen2-VL's `mm_token_type_ids` (1-D)
    image_token_ids: list[int] = field(default_factory=list)  # never generated: a completion is text


def _turns(cfg: RunConfig, row: dict, place: str) -> list[dict]:
    prompt = row.get(cfg.data.prompt_column)
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    key = "data.prompt_column"
    if not isinstance(turns, list) or not all(isinstance(t, dict) and t.get("role") for t in turns):
        raise UserError(Problem(key, f"{place}: expected text or a list of {{role, content}} turns", where=place,
                                fix="fix the row, or point the key at the right column"))
    return [{"role": t["role"], "content": vision_rows.content_parts(t.get("content"), place, key)} for t in turns]


def problems(cfg: RunConfig, rows) -> list[Problem]:
    base, found = Path(cfg.data.source).expanduser().parent, []
    for index, row in enumerate(rows.rows):
        place = rows.place(index)
        try:
            refs = vision_rows.row_images(cfg, row, _turns(cfg, row, place), place)
        except UserError as error:
            found += error.problems
            continue
        found += [p for p in (vision_rows.image_problem(r, base, place) for r in refs) if p]
        if len(found) >= 20:
            break
    return found


def encode(cfg: RunConfig, processor) -> VisionPromptSet:
    rows = vision_rows.table(cfg)
    base = Path(cfg.data.source).expanduser().parent
    prompts, ids, images = [], [], []
    for index, row in enumerate(rows.rows):
        place = rows.place(index)
        turns = _turns(cfg, row, place)
        opened = [vision_rows.open_image(r, base, place) for r in vision_rows.row_images(cfg, row, turns, place)]
        encoded = processor.encode(processor.render(turns, add_generation_prompt=True), opened)
        prompt_ids = encoded["input_ids"][0]
        if len(prompt_ids) > cfg.data.max_length:
            raise UserError(Problem("data.max_length", f"{place}: the prompt is {len(prompt_ids)} tokens with its "
                                    f"images, more than data.max_length={cfg.data.max_length}", where=place,
                                    fix="raise data.max_length, or make the images smaller"))
        types = {"mm_token_type_ids": encoded["mm_token_type_ids"][0]} if "mm_token_type_ids" in encoded else {}
        images.append({**types, **{k: encoded[k] for k in IMAGE_INPUTS if k in encoded}})
        prompts.append(row.get(cfg.data.prompt_column))
        ids.append(prompt_ids.tolist())
    return VisionPromptSet(list(rows.rows), prompts, ids, conversational=isinstance(prompts[0], list), images=images,
                           image_token_ids=list(processor.image_token_ids))


def image_inputs(prompts: VisionPromptSet, rows: list[int], prompt_width: int, completion_width: int,
                 device) -> dict:
    """The image inputs of prompts `rows` (left-padded to `prompt_width`, then `completion_width` completion
    tokens): each row's images in order, and its image-token types where its prompt tokens sit. For generation
    (no completion yet) the image tokens are suppressed too: a completion is text, and an image token in it would
    stand for an image the row does not have."""
    found = [prompts.images[i] for i in rows]
    out: dict = {}
    if "mm_token_type_ids" in found[0]:  # Qwen2-VL's: its 3-D positions are read from them
        types = torch.zeros((len(rows), prompt_width + completion_width), dtype=torch.long)
        for j, image in enumerate(found):
            n = len(image["mm_token_type_ids"])
            types[j, prompt_width - n:prompt_width] = image["mm_token_type_ids"]
        out["mm_token_type_ids"] = types.to(device)
    if not completion_width:
        out["suppress_tokens"] = prompts.image_token_ids
    for key in IMAGE_INPUTS:
        parts = [image[key] for image in found if key in image]
        if parts:
            out[key] = torch.cat(parts, dim=0).to(device)
    return out
