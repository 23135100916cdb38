"""Preference pairs with images (`preference.method` dpo, ipo, simpo or orpo on a vision-language model): a prompt
whose turns hold the row's images, a chosen and a rejected answer (docs/vision.md).

    TRL's vision pairs   `images`, `prompt` (turns whose content is a list of text and {"type": "image"}
                         parts, or text with `<image>`), `chosen` and `rejected` (text, one message or turns)
    LLaMA-Factory's      ShareGPT or Alpaca pairs with `<image>` in the prompt's text and an `images` list

Each pair is two rows through the processor with the same images: prompt + chosen and prompt + rejected.
The loss is over the completion alone: every token before the end of the prompt (rendered with the
generation prompt, its images expanded) is left out, image tokens with it. The collator puts a batch's
chosen rows and then its rejected rows in one padded batch, their images in the same order, so one
forward scores both (as TRL's `concatenated_forward`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from overdrive.data import preference_layouts, vision_rows
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def _turns(value: Any, role: str, place: str, key: str) -> list[dict]:
    """A cell as turns with content parts: text is one turn of `role`; a message, or a list of them."""
    if isinstance(value, str):
        value = [{"role": role, "content": value}]
    elif isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) and t.get("role") for t in value):
        raise UserError(Problem(key, f"{place}: expected text or a list of {{role, content}} turns", where=place,
                                fix="fix the row, or point the key at the right column"))
    return [{"role": t["role"], "content": vision_rows.content_parts(t.get("content"), place, key)} for t in value]


def pair_turns(cfg: RunConfig, row: dict, index: int, place: str, layout: str, columns: dict) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) turns of one row, their content as parts."""
    d = cfg.data
    if layout != "trl":  # ShareGPT and Alpaca pairs: text with <image> placeholders
        text_row = {k: v for k, v in row.items() if k != d.images_column}
        cells = preference_layouts.pair_of(layout, columns, text_row, index, d)
    else:
        if not columns.get("prompt"):
            raise UserError(Problem("data.prompt_column", f"pairs with images need a prompt column "
                                    f"({d.prompt_column!r} is not in the data)", fix="set data.prompt_column"))
        cells = {part: row.get(columns[part]) for part in ("prompt", "chosen", "rejected")}
    keys = preference_layouts.KEYS
    return (_turns(cells["prompt"], "user", place, keys["prompt"]),
            _turns(cells["chosen"], "assistant", place, keys["chosen"]),
            _turns(cells["rejected"], "assistant", place, keys["rejected"]))


def encode_pair(processor, prompt: list, answer: list, images: list, place: str, max_length: int, overlong: str):
    """One side of a pair: its labels the answer's tokens alone (None when too long and dropped)."""
    import torch

    from overdrive.data.vision_samples import IGNORE, encode, prompt_length

    row = encode(processor, prompt + answer, images, place, max_length, overlong=overlong)
    if row is None:
        return None
    start = prompt_length(processor, prompt, images)
    row["labels"][:start] = IGNORE  # an earlier assistant turn in the prompt is context, not the completion
    # ORPO's NLL is over the whole chosen sequence (TRL's), prompt included, but never over an image's tokens
    image = torch.isin(row["input_ids"], torch.tensor(processor.image_token_ids, dtype=row["input_ids"].dtype))
    row["text_mask"] = row["attention_mask"] * ~image
    return row


class VisionPairCollator:
    """Chosen rows, then rejected rows, padded together; their images concatenated in that order."""

    def __init__(self, pad_id: int):
        from overdrive.data.vision_samples import VisionCollator

        self.rows = VisionCollator(pad_id)

    def __call__(self, pairs: list[dict]) -> dict:
        import torch

        batch = self.rows([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs])
        batch["pair_index"] = torch.stack([p["pair_index"] for p in pairs])
        return batch


def read_pair(cfg: RunConfig, rows, index: int, layout: str, columns: dict) -> tuple[list, list, list, list]:
    """(prompt, chosen, rejected, image references) of row `index`, refused by key where they do not fit."""
    place, row = rows.place(index), rows.rows[index]
    prompt, chosen, rejected = pair_turns(cfg, row, index, place, layout, columns)
    if any(p["type"] == "image" for t in chosen + rejected for p in t["content"]):
        raise UserError(Problem("data.images_column", f"{place}: an image in an answer; a pair's images are the "
                                "prompt's", where=place, fix="put the images in the prompt"))
    return prompt, chosen, rejected, vision_rows.row_images(cfg, row, prompt, place)


def layout_of(cfg: RunConfig, rows) -> tuple[str, dict]:
    layout = preference_layouts.recognise_pairs(rows.columns, cfg.data)
    return layout, preference_layouts.pair_columns(layout, rows.columns, cfg.data)


def problems(cfg: RunConfig, rows) -> list[Problem]:
    """Every pair read and its images found, before the model loads (vision_rows.problems for conversations)."""
    base, found = Path(cfg.data.source).expanduser().parent, []
    try:
        layout, columns = layout_of(cfg, rows)
    except UserError as error:
        return list(error.problems)
    for index in range(len(rows.rows)):
        try:
            refs = read_pair(cfg, rows, index, layout, columns)[3]
        except UserError as error:
            found += error.problems
            continue
        found += [p for p in (vision_rows.image_problem(r, base, rows.place(index)) for r in refs) if p]
        if len(found) >= 20:
            break
    return found


def prepare(cfg: RunConfig, processor, show: bool = False):
    """The pairs of the data file encoded (tokens.TokenizedSplits of {"chosen", "rejected", "pair_index"} rows);
    `data.validation_fraction` of them held out."""
    import torch

    from overdrive.data import tokens
    from overdrive.data.vision_samples import VisionRows

    d = cfg.data
    rows = vision_rows.table(cfg)
    layout, columns = layout_of(cfg, rows)
    base = Path(d.source).expanduser().parent
    train: list = []
    validation: list = []
    dropped = 0
    for index in range(len(rows.rows)):
        place = rows.place(index)
        prompt, chosen, rejected, refs = read_pair(cfg, rows, index, layout, columns)
        images = [vision_rows.open_image(ref, base, place) for ref in refs]
        sides = [encode_pair(processor, prompt, answer, images, place, d.max_length, d.overlong)
                 for answer in (chosen, rejected)]
        if None in sides:
            dropped += 1
            continue
        split = validation if tokens.held_out(cfg.training.seed, index, d.validation_fraction) else train
        split.append({"chosen": sides[0], "rejected": sides[1], "pair_index": torch.tensor(len(split))})
    if not train:
        raise UserError(Problem("data.source", f"{d.source!r} gave no training pairs", fix="give more rows, or "
                                "lower data.validation_fraction"))
    if show:
        print(f"vision: {len(rows.rows):,} preference pairs with images ({len(validation):,} held out, {dropped:,} "
              f"dropped as longer than {d.max_length} tokens)", flush=True)
    return tokens.TokenizedSplits(VisionRows(train), VisionRows(validation) if validation else None, d.max_length, [])
