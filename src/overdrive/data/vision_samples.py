"""A vision-language data set as the loop reads it: each row rendered by the chat template, its
images through the processor, the loss over the assistant's tokens only, image tokens never in it.

    encode(processor, turns, images, ...)   one row -> the model's inputs and `labels`
    prepare(cfg, processor)                 TokenizedSplits of encoded rows (train, held-out validation)
    VisionCollator                          rows -> a padded batch (image tensors concatenated)

Where the loss is taken: the conversation is rendered prefix by prefix (as data/chat.py does for a
template without {% generation %} marks): the processor's tokens of the text before an assistant
turn (with the generation prompt) and through its end bound the answer. The prefixes go through the
processor with their own images, so image tokens are expanded in them as in the whole row; a template
whose prefix tokens differ from the row's is refused by key. Rows are encoded as the run starts, on
every process alike (no token cache for images yet): a data set of thousands of images pays it once per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from overdrive.data import layouts, tokens, vision_rows
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

IGNORE, SEQUENCE = vision_rows.IGNORE, vision_rows.SEQUENCE


def _length(processor, text: str, images: list) -> tuple[int, list[int]]:
    if not text:
        return 0, []
    count = text.count(processor.image_token) if processor.image_token else 0
    ids = processor.encode(text, images[:count])["input_ids"][0].tolist()
    return len(ids), ids


def prompt_length(processor, prompt: list[dict], images: list) -> int:
    """Tokens of a prompt rendered with the generation prompt, its images expanded: where its answer starts."""
    return _length(processor, processor.render(prompt, add_generation_prompt=True), images)[0]


def encode(processor, turns: list[dict], images: list, place: str, max_length: int, train_on_prompt: bool = False,
           overlong: str = "truncate") -> Optional[dict]:
    """One row's inputs (each of shape (tokens,) or the processor's image shapes) with `labels`; None when
    it is longer than `max_length` and `data.overlong` drops it."""
    text = processor.render(turns)
    row = {k: v for k, v in processor.encode(text, images).items()}
    ids = row["input_ids"][0]
    mask = torch.ones_like(ids, dtype=torch.bool) if train_on_prompt else torch.zeros_like(ids, dtype=torch.bool)
    if not train_on_prompt:
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = processor.render(turns[:i], add_generation_prompt=True) if i else ""
            upto = processor.render(turns[:i + 1])
            (start, head), (end, whole) = _length(processor, before, images), _length(processor, upto, images)
            if not (text.startswith(before) and text.startswith(upto)) or ids[:end].tolist() != whole \
                    or ids[:start].tolist() != head:
                raise UserError(Problem("tokenizer.chat_template", f"{place}: the template renders a "
                                        "conversation's beginning differently from the whole, so the assistant's "
                                        "tokens cannot be found", place, "use a template whose prefixes render "
                                        "as the conversation's, or set data.train_on_prompt=true"))
            mask[start:end] = True
    image = torch.isin(ids, torch.tensor(processor.image_token_ids, dtype=ids.dtype))
    if "mm_token_type_ids" in row:
        image |= row["mm_token_type_ids"][0] != 0
    labels = torch.where(mask & ~image, ids, torch.full_like(ids, IGNORE))  # image tokens never in the loss
    out = {k: (v[0] if k in SEQUENCE else v) for k, v in row.items() if isinstance(v, torch.Tensor)}
    out["labels"] = labels
    if len(ids) > max_length:
        last_image = int(image.nonzero().max()) if image.any() else -1
        if last_image >= max_length:
            raise UserError(Problem("data.max_length", f"{place}: {len(ids)} tokens, an image's tokens reaching "
                                    f"past {max_length}: a row is never cut inside an image", place,
                                    f"raise data.max_length above {last_image + 1}, or make the images smaller "
                                    "(the image processor's max_pixels)"))
        if overlong == "drop":
            return None
        out = {k: (v[:max_length] if k in SEQUENCE else v) for k, v in out.items()}
    return out


class VisionRows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class VisionCollator:
    """Rows padded to the batch's longest (pad id, attention 0, labels ignored); image tensors
    (pixel_values, image_grid_thw, ...) concatenated in row order, as the processor batches them."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(r["input_ids"]) for r in rows)
        fill = {"input_ids": self.pad_id, "labels": IGNORE}
        batch = {}
        for key in rows[0]:
            values = [r[key] for r in rows]
            if key == "position_ids":  # packed rows, all `block` long: (4, batch, seq) for 3-D positions
                batch[key] = torch.stack(values, dim=-2)
            elif key in SEQUENCE:
                batch[key] = torch.stack([torch.nn.functional.pad(v, (0, longest - len(v)), value=fill.get(key, 0))
                                          for v in values])
            else:
                batch[key] = torch.cat(values, dim=0)
        return batch


def prepare(cfg: RunConfig, processor, show: bool = False, rope=None) -> tokens.TokenizedSplits:
    """Every row of the data file encoded; `data.validation_fraction` of them held out (by the seed); with
    `data.packing`, packed with their images (data/vision_packing.py; `rope`: hf/vision.rope_index)."""
    d = cfg.data
    rows = vision_rows.table(cfg)
    layout, columns = layouts.recognise(rows.columns, d)
    base = Path(d.source).expanduser().parent
    train, validation, counts = [], [], {"rows": 0, "dropped": 0, "loss_tokens": 0, "image_tokens": 0}
    for index in range(len(rows.rows)):
        place = rows.place(index)
        turns, refs = vision_rows.conversation(cfg, rows, index, layout, columns)
        images = [vision_rows.open_image(ref, base, place) for ref in refs]
        encoded = encode(processor, turns, images, place, d.max_length, d.train_on_prompt, d.overlong)
        counts["rows"] += 1
        if encoded is None:
            counts["dropped"] += 1
            continue
        counts["loss_tokens"] += int((encoded["labels"][1:] != IGNORE).sum())
        counts["image_tokens"] += int(torch.isin(encoded["input_ids"], torch.tensor(processor.image_token_ids)).sum())
        (validation if tokens.held_out(cfg.training.seed, index, d.validation_fraction) else train).append(encoded)
    if not train:
        raise UserError(Problem("data.source", f"{d.source!r} gave no training rows", fix="give more rows, or "
                                "lower data.validation_fraction"))
    if show:
        print(f"vision: {counts['rows']:,} rows ({len(validation):,} held out, {counts['dropped']:,} dropped as "
              f"longer than {d.max_length} tokens), {counts['loss_tokens']:,} tokens in the loss, "
              f"{counts['image_tokens']:,} image tokens", flush=True)
    if d.packing:
        from overdrive.data.vision_packing import PackedVisionRows

        return tokens.TokenizedSplits(PackedVisionRows(train, d.max_length, processor.pad_token_id, rope),
                                      PackedVisionRows(validation, d.max_length, processor.pad_token_id, rope)
                                      if validation else None, d.max_length, [])
    return tokens.TokenizedSplits(VisionRows(train), VisionRows(validation) if validation else None, d.max_length, [])
