"""Rows of a vision-language data set: a conversation whose turns hold text and image parts, and the
row's images, in the layouts users have.

    messages   TRL's: `data.messages_column` turns whose content is a list of parts, {"type": "image"}
               among them, and an `images` column (`data.images_column`) in the order the parts come
    sharegpt / alpaca   LLaMA-Factory's: `<image>` placeholders in the text, and an `images` list

Every layout is read into turns whose content is a list of parts ({"type": "text", "text": ...},
{"type": "image"}), which the chat template of a vision-language model renders as its image token.
An image is a path (relative to the data file's directory) or a {"path"} / {"bytes"} mapping (a
`datasets` Image column written to parquet). A row whose placeholders and images differ in number is
refused by `data.images_column`, naming the row, before the model loads (`problems`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from overdrive.data import layouts
from overdrive.data.row_table import RowTable, local_table
from overdrive.errors import Problem, UserError
from overdrive.hf.vision import unopened_image

IGNORE = -100  # a label the loss leaves out
# One value per token; `text_mask`: a pair's real tokens that are not an image's (ORPO's NLL, data/vision_pairs.py).
SEQUENCE = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "text_mask")

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

PLACEHOLDER = "<image>"  # LLaMA-Factory's (and Axolotl's) mark of an image in ShareGPT and Alpaca text


def table(cfg: RunConfig) -> RowTable:
    """The data file's rows; only a local file is read in this release (refused by key otherwise)."""
    found = local_table(cfg.data.source)
    if found is None:
        raise UserError(Problem("data.source", f"{cfg.data.source!r}: a vision-language run reads a local jsonl, "
                                "json, csv or parquet file", fix="point data.source at such a file (a hub data set "
                                "or a save_to_disk directory: save its rows as jsonl or parquet first)"))
    return found


def content_parts(content: Any, row: str, key: str) -> list[dict]:
    """A turn's content as parts: `<image>` in a string splits it; a list keeps its text and image parts."""
    if content is None:
        return []
    if isinstance(content, str):
        pieces = content.split(PLACEHOLDER)
        parts: list[dict] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts += content_parts(part["text"], row, key) if PLACEHOLDER in part["text"] else [dict(part)]
            else:
                raise UserError(Problem(key, f"{row}: a content part that is neither text nor an image: "
                                        f"{str(part)[:80]}", fix='write parts as {"type": "text", "text": ...} or '
                                        '{"type": "image"}'))
        return parts
    raise UserError(Problem(key, f"{row}: a turn's content is a {type(content).__name__}",
                            fix="give text (with <image> placeholders) or a list of text and image parts"))


def conversation(cfg: RunConfig, rows: RowTable, index: int, layout: str, columns: tuple) -> tuple[list[dict], list]:
    """(turns with content parts, the row's images) of row `index`; refused by key where the images and
    the placeholders differ in number."""
    d, row, place = cfg.data, rows.rows[index], rows.place(index)
    key = "data.messages_column" if layout == "messages" else "data.layout"
    if layout == "messages":
        raw = row[columns[0]]
        if not isinstance(raw, list) or not raw:
            raise UserError(Problem(key, f"{place}: expected a list of {{role, content}} turns", where=place,
                                    fix="fix the row, or point the key at the right column"))
        turns = []
        for turn in raw:
            if not isinstance(turn, dict) or turn.get("role") not in layouts.ROLES:
                raise UserError(Problem(key, f"{place}: a turn without a known role: {str(turn)[:80]}", where=place,
                                        fix=f"every turn needs a role ({', '.join(layouts.ROLES)}) and a content"))
            turns.append({"role": turn["role"], "content": turn.get("content")})
    else:
        text_row = {k: v for k, v in row.items() if k != d.images_column}
        turns = layouts.turns_of(layout, columns, text_row, index, d)
    turns = [{"role": t["role"], "content": content_parts(t["content"], place, key)} for t in turns]
    if not any(t["role"] == "assistant" for t in turns):
        raise UserError(Problem(key, f"{place}: a conversation without an assistant turn", where=place,
                                fix="every conversation needs an answer to learn: drop or fix the row"))
    return turns, row_images(cfg, row, turns, place)


def row_images(cfg: RunConfig, row: dict, turns: list[dict], place: str) -> list:
    """The row's images, refused by `data.images_column` where they and the turns' image parts differ in number."""
    d = cfg.data
    images = row.get(d.images_column)
    images = [] if images is None else images if isinstance(images, list) else [images]
    marks = sum(p["type"] == "image" for t in turns for p in t["content"])
    if marks != len(images):
        raise UserError(Problem("data.images_column",
                                f"{place}: {marks} image placeholder(s) in the conversation and {len(images)} "
                                f"image(s) in column {d.images_column!r}", where=place,
                                fix="give one image per {\"type\": \"image\"} part (or <image> mark), in order"))
    return images


def image_problem(image: Any, base: Path, place: str) -> Optional[Problem]:
    """Where an image cannot be read from: a Problem (None when it can, as far as a look at the file tells)."""
    key = "data.images_column"
    if isinstance(image, dict) and image.get("bytes"):
        return unopened_image(io.BytesIO(image["bytes"]), "its bytes", place)
    path = image.get("path") if isinstance(image, dict) else image
    if not isinstance(path, str) or not path:
        return Problem(key, f"{place}: an image that is no path: {str(image)[:80]}", place,
                       "give each image as a path (relative to the data file) or a {\"path\"} / {\"bytes\"} mapping")
    if path.startswith(("http://", "https://")):
        return Problem(key, f"{place}: {path[:80]} is a URL; images are read from files", place,
                       "download the images and give their paths")
    if not (base / path).expanduser().is_file():
        return Problem(key, f"{place}: no image file {path}", place, f"paths are read from {base}")
    return unopened_image((base / path).expanduser(), path, place)


def open_image(image: Any, base: Path, place: str):
    """The image as an RGB PIL image, or refused by `data.images_column` naming the row."""
    from PIL import Image

    problem = image_problem(image, base, place)
    if problem is not None:
        raise UserError(problem)
    try:
        if isinstance(image, dict) and image.get("bytes"):
            return Image.open(io.BytesIO(image["bytes"])).convert("RGB")
        path = image.get("path") if isinstance(image, dict) else image
        with Image.open((base / path).expanduser()) as opened:
            return opened.convert("RGB")
    except OSError as error:
        raise UserError(Problem("data.images_column", f"{place}: the image does not open: {error}", place,
                                "replace or drop the image")) from None


def problems(cfg: RunConfig, rows: RowTable) -> list[Problem]:
    """Every conversation of a local data file checked before the model loads: the layout, the images
    against the placeholders, the image files there (pairs: vision_pairs.problems)."""
    try:
        layout, columns = layouts.recognise(rows.columns, cfg.data)
    except UserError as error:
        return list(error.problems)
    base, found = Path(cfg.data.source).expanduser().parent, []
    for index in range(len(rows.rows)):
        try:
            _, images = conversation(cfg, rows, index, layout, columns)
        except UserError as error:
            found += error.problems
            continue
        found += [p for p in (image_problem(image, base, rows.place(index)) for image in images) if p]
        if len(found) >= 20:  # enough to act on; the rest are said once these are fixed
            break
    return found
