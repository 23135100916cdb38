"""Preference data: rows of a prompt and a chosen and a rejected answer, for `preference.method`.

Rows are read into TRL's layouts: each of `prompt`, `chosen`, `rejected` is text (the
standard layout) or a list of {role, content} turns (the conversational one); without a
prompt column the prompt is the turns the two answers share (TRL's `extract_prompt`). The
other tools' layouts (ShareGPT and Alpaca pairs, single-message answers) and KTO's unpaired
rows are recognised by their columns in preference_layouts.py; KTO's rows are rendered and
batched by preference_unpaired.py.

A pair is rendered as TRL's DPOTrainer renders it: conversational rows through the chat
template (the prompt with the generation prompt, prompt + answer without), text rows by the
tokenizer with EOS added to each answer; the answer starts where the tokenized prompt and
prompt + answer first differ. Each side is one sequence, prompt then answer, with a loss
mask over the answer, truncated at `data.max_length` (keeping the start); a pair whose
prompt alone fills `data.max_length` has no answer left and is dropped. Both are counted.

In the token cache a pair is two consecutive conversations of the chat layout (chat.py):
row 2i is the chosen sequence, row 2i+1 the rejected one, so a held-out pair stays whole.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from overdrive.data import row_checks
from overdrive.data.chat import KINDS
from overdrive.data import preference_layouts as layouts
from overdrive.data.sources import Batch, Rows, row_batches
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

def is_preference(cfg: RunConfig) -> bool:
    return cfg.data.format == "preference"


class PreferenceRows(Rows):
    """Rows of a `datasets` table or stream, read as pairs (a Batch's `texts` are dicts of
    prompt, chosen and rejected, each a string or a list of turns) in any layout of
    preference_layouts.py; under KTO, as lists of unpaired rows (prompt, completion, desirable)."""

    def __init__(self, rows: Rows, cfg: RunConfig):
        super().__init__(rows.dataset, rows.key, None, None, rows.total, None, rows.files)
        self.reader = PairReader(cfg, rows.column_names())
        self.columns = self.reader.columns
        kind = "kto|" if self.reader.unpaired else ""
        self.key = f"preference|{kind}{self.reader.layout}|{'|'.join(self.columns)}|{rows.key}"

    def pair(self, row: dict, index: int):
        return self.reader.pair(row, index)

    def batches(self, start: Optional[dict] = None, batch_bytes: int = 1 << 20) -> Iterator[Batch]:
        with self.reading():
            yield from row_batches(self.dataset, self.columns, self.pair, start, batch_bytes)


def template_key(cfg: RunConfig, tokenizer) -> str:
    """What the token cache entry depends on beyond the tokenizer's vocabulary."""
    digest = hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:16]
    return f"preference|{'kto|' if cfg.preference.method == 'kto' else ''}{digest}"


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


Side = tuple[list[int], list[int]]  # (ids, answer mask)


class PreferenceEncoder:
    """Pairs -> ((chosen ids, mask), (rejected ids, mask)), or None for a pair dropped."""

    task = "preference"
    kinds = KINDS

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.counts = {"pairs": 0, "truncated": 0, "dropped": 0, "loss_tokens": 0}

    def __call__(self, pairs: list[dict]) -> list[Optional[tuple[Side, Side]]]:
        return [self.encode(pair) for pair in pairs]

    def _ids(self, value, **kwargs) -> list[int]:
        tok = self.tokenizer
        if isinstance(value, list):
            if not getattr(tok, "chat_template", None):
                raise UserError(Problem("tokenizer.chat_template", "the preference rows are turns, and the tokenizer "
                                        "has no chat template", fix="set tokenizer.chat_template to a Jinja template "
                                        "(or a .jinja file), or use a tokenizer that ships one"))
            return list(tok.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)["input_ids"])
        return list(tok(text=value)["input_ids"])

    def render(self, pair: dict) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, chosen ids, rejected ids) as TRL's DPOTrainer tokenizes them."""
        prompt, chosen, rejected = pair["prompt"], pair["chosen"], pair["rejected"]
        if isinstance(chosen, list):
            prompt_ids = self._ids(prompt, add_generation_prompt=True)
            with_chosen, with_rejected = self._ids(prompt + chosen), self._ids(prompt + rejected)
        else:
            eos = self.tokenizer.eos_token or ""
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
            prompt_ids = self._ids(prompt)
            with_chosen, with_rejected = self._ids(prompt + chosen), self._ids(prompt + rejected)
        n = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
        return prompt_ids[:n], with_chosen[n:], with_rejected[n:]

    def encode(self, pair: dict) -> Optional[tuple[Side, Side]]:
        self.counts["pairs"] += 1
        if pair.get("identical_row") is not None:  # chosen == rejected: a loss of ln 2 that teaches nothing
            self.counts["identical"] = self.counts.get("identical", 0) + 1
            self.counts.setdefault("first_identical_row", pair["identical_row"])
            return None
        prompt, chosen, rejected = self.render(pair)
        if len(prompt) >= self.max_length:  # nothing of either answer would be left
            self.counts["dropped"] += 1
            return None
        sides = []
        for answer in (chosen, rejected):
            ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
            sides.append((ids[:self.max_length], mask[:self.max_length]))
        if any(len(prompt) + len(a) > self.max_length for a in (chosen, rejected)):
            self.counts["truncated"] += 1
        self.counts["loss_tokens"] += sum(sum(m) for _, m in sides)
        return sides[0], sides[1]

    def append(self, writer, part: str, rows: list[int], encoded: list) -> None:
        """Write the chosen rows' pairs as two conversations each (a dropped pair writes nothing)."""
        kept = [side for i in rows if encoded[i] is not None for side in encoded[i]]
        if not kept:
            return
        base = writer.count(part)
        ends = np.cumsum([len(ids) for ids, _ in kept]) + base
        writer.append(part, np.concatenate([np.asarray(ids) for ids, _ in kept]), ends=ends.astype(np.int64),
                      mask=np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in kept]))

    def summary(self) -> dict:
        identical = self.counts.get("identical", 0)
        if identical and identical == self.counts["pairs"]:
            raise UserError(Problem("data.rejected_column", f"every pair ({identical:,}) has a rejected answer equal "
                                    f"to its chosen one (row {self.counts['first_identical_row']} first): nothing to "
                                    "prefer", fix="point data.chosen_column and data.rejected_column at the two "
                                    "different answers"))
        return {"preference": {**self.counts, "max_length": self.max_length}}


def describe_counts(counts: dict) -> str:
    text = f"{counts['pairs']:,} pairs, {counts['loss_tokens']:,} answer tokens"
    if counts["truncated"]:
        text += f"; {counts['truncated']:,} longer than {counts['max_length']} tokens truncated (data.max_length)"
    if counts["dropped"]:
        text += (f"; {counts['dropped']:,} dropped: the prompt alone fills {counts['max_length']} tokens "
                 "(data.max_length)")
    if counts.get("identical"):
        text += (f"; {counts['identical']:,} dropped: chosen equals rejected, nothing to prefer (row "
                 f"{counts['first_identical_row']} first)")
    return text


class PairReader:
    """How one row of a preference (or KTO) set is read, decided from its column names alone: the
    training path (PreferenceRows) and the check of a local file's every row before the model loads
    (row_problems) read rows the same way."""

    def __init__(self, cfg: RunConfig, names: list[str]):
        d = cfg.data
        self.data, self.unpaired = d, cfg.preference.method == "kto"
        kto = layouts.unpaired_columns(names, d) if self.unpaired else {}
        if not self.unpaired or "paired" in kto:
            for key, column in (("data.chosen_column", d.chosen_column), ("data.rejected_column", d.rejected_column)):
                if column not in names:
                    raise UserError(Problem(key, f"no column {column!r} in {cfg.data.source}; the data has {names}",
                                            fix=f"set {key} to the column holding that answer"))
            self.layout = layouts.recognise_pairs(names, d)
            self.names = layouts.pair_columns(self.layout, names, d)
        else:
            self.layout, self.names = "unpaired", kto
        self.columns = tuple(dict.fromkeys(c for k, c in self.names.items() if c and k != "layout"))

    def pair(self, row: dict, index: int):
        """One row as {prompt, chosen, rejected}: all text, or all turns; refused by key otherwise.
        Under KTO: a list of {prompt, completion, desirable} (a pair gives two)."""
        if self.layout == "unpaired":
            return [layouts.unpaired_of(self.names, row, index)]
        cells = layouts.pair_of(self.layout, self.names, row, index, self.data)
        if self.unpaired:  # TRL's unpair_preference_dataset: the chosen answer desirable, the rejected one not
            return [{"prompt": cells["prompt"], "completion": cells[part], "desirable": part == "chosen"}
                    for part in ("chosen", "rejected")]
        conversational = isinstance(cells["chosen"], list)
        if conversational:
            if not cells["prompt"]:
                raise UserError(Problem("data.prompt_column", f"row {index + 1}: no prompt: the data has no column "
                                        f"{self.data.prompt_column!r} and chosen and rejected share no turns to take "
                                        "it from", fix="set data.prompt_column to the column holding the prompt"))
            for part in ("chosen", "rejected"):
                if cells[part]:
                    row_checks.answer(cells[part], index, layouts.KEYS[part])
        if cells["chosen"] == cells["rejected"]:  # nothing to prefer: dropped and counted (PreferenceEncoder)
            cells["identical_row"] = index
        return cells


def row_problems(cfg: RunConfig, names: list[str], rows: list[dict], place) -> list[Problem]:
    """Every row of a local preference or KTO file read as training reads it, before anything is written:
    the problems of the first rows that fail (each with its file and line, `place(index)`)."""
    try:
        reader = PairReader(cfg, names)
    except UserError as error:
        return list(error.problems)
    found: list[Problem] = []
    for index, row in enumerate(rows):
        try:
            reader.pair({name: row.get(name) for name in names}, index)
        except UserError as error:
            found += [Problem(p.key, p.message, p.where or place(index), p.fix) for p in error.problems]
        except (KeyError, TypeError, AttributeError) as error:  # a cell of a shape the layout does not read
            found.append(Problem("data.source", f"row {index + 1}: cannot be read as a preference row ({error})",
                                 place(index), "fix the row, or set data.layout to the data's layout"))
        if len(found) >= 5:  # enough to fix; the rest come after
            break
    return found
