"""Chat data for supervised fine-tuning: conversations rendered by the tokenizer's own chat
template, with a loss mask over the assistant's tokens.

    ChatRows       rows of conversations: a `data.messages_column` of {role, content} turns,
                   or prompt/completion columns (a string or a list of turns each), as TRL reads them
    with_template  the tokenizer given its chat template (`tokenizer.chat_template`), or refused by key
    ChatEncoder    a conversation -> (token ids, loss mask), truncated or dropped at data.max_length
    ChatEntry      what the token cache holds for chat: ids, a uint8 mask, and each conversation's end

Where the loss is taken: with a template that marks the assistant's text with
`{% generation %}`, Transformers returns that mask (`return_assistant_tokens_mask`).
Otherwise the conversation is rendered prefix by prefix, as TRL does for prompt/completion
data: the text up to an assistant turn with the generation prompt, then up to the end of
that turn; the characters between are the answer, and the tokens starting there are masked
in through the tokenizer's offsets. A template whose rendering of a prefix is not a prefix
of the whole conversation cannot be split that way and is refused by key.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from overdrive.data import layouts
from overdrive.data.sources import Batch, Rows, row_batches
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

KINDS = ("ids", "ends", "mask")  # the token cache's files for chat
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def is_chat(cfg: RunConfig) -> bool:
    return cfg.data.format == "chat"


def sample_kind(cfg: RunConfig) -> str:
    """What a training sample is: `chat`, `preference` (pairs), `unpaired` (KTO's rows), or the model task's
    (packed text, labelled rows)."""
    if cfg.data.format == "preference":
        return "unpaired" if cfg.preference.method == "kto" else "preference"
    return "chat" if is_chat(cfg) else cfg.model.task


# ---------------------------------------------------------------- rows


class ChatRows(Rows):
    """Rows of a `datasets` table or stream, read as conversations (a Batch's `texts` are lists of turns)."""

    def __init__(self, rows: Rows, cfg: RunConfig):
        d = cfg.data
        super().__init__(rows.dataset, rows.key, None, None, rows.total, None, rows.files)
        names = rows.column_names()
        self.data = d
        self.layout, self.columns = layouts.recognise(names, d)
        self.extra = layouts.extra_columns(names, d)
        self.key = f"chat|{self.layout}|{'|'.join(self.columns + self.extra)}|{rows.key}"

    def conversation(self, row: dict, index: int):
        """The row's turns, or {messages, tools} when the row offers tools to the template."""
        turns = layouts.turns_of(self.layout, self.columns, row, index, self.data)
        if not any(t["role"] == "assistant" for t in turns):
            raise UserError(Problem("data.layout" if self.layout in ("sharegpt", "alpaca") else
                                    "data.messages_column" if self.layout == "messages" else "data.completion_column",
                                    f"row {index}: a conversation without an assistant turn (roles: "
                                    f"{[t['role'] for t in turns]})",
                                    fix="every conversation needs an answer to learn: drop or fix the row"))
        tools = layouts.tools_of(row, index, self.data)
        return {"messages": turns, "tools": tools} if tools else turns

    def batches(self, start: Optional[dict] = None, batch_bytes: int = 1 << 20) -> Iterator[Batch]:
        with self.reading():
            yield from row_batches(self.dataset, self.columns + self.extra, self.conversation, start, batch_bytes)


# ---------------------------------------------------------------- template


def with_template(cfg: RunConfig, tokenizer, source: str):
    """The tokenizer with its chat template: `tokenizer.chat_template` (text or a file) wins,
    else the tokenizer's own; refused by key when there is none, when a value that is no Jinja
    names no file, and when the template does not compile."""
    given = cfg.tokenizer.chat_template
    if given:
        path = Path(given).expanduser()
        if "{" in given:
            tokenizer.chat_template = given
        elif path.is_file():
            tokenizer.chat_template = path.read_text()
        else:
            raise UserError(Problem("tokenizer.chat_template", f"{given!r} is no Jinja template (no {{{{ or {{%) "
                                    "and no file", fix="give the template itself, or the path of a file holding it"))
    d = cfg.data
    own = all(e.chat_template for e in d.sources) if d.sources else bool(d.chat_template)  # each data its own
    if not getattr(tokenizer, "chat_template", None) and not own:
        raise UserError(Problem("tokenizer.chat_template", f"the tokenizer of {source} has no chat template, and "
                                "data.format is chat", fix="set tokenizer.chat_template to a Jinja template (or a "
                                ".jinja file), or use a tokenizer that ships one"))
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # Transformers' own environment

    try:
        if isinstance(tokenizer.chat_template, str):
            _compile_jinja_template(tokenizer.chat_template)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(Problem("tokenizer.chat_template", f"the chat template does not compile: {error.message} "
                                f"(line {error.lineno})", fix="fix the template's Jinja syntax")) from None
    return tokenizer


def template_key(cfg: RunConfig, tokenizer) -> str:
    """What the token cache entry depends on beyond the tokenizer's vocabulary."""
    d = cfg.data
    digest = hashlib.sha256(str(for_data(cfg, tokenizer).chat_template).encode()).hexdigest()[:16]
    return f"chat|{digest}|prompt={d.train_on_prompt}|{d.overlong}"


# ---------------------------------------------------------------- encoding


class ChatEncoder:
    """Conversations -> (ids, mask) pairs, or None for a conversation dropped as too long."""

    task = "chat"
    kinds = KINDS

    def __init__(self, tokenizer, max_length: int, train_on_prompt: bool = False, overlong: str = "truncate"):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.train_on_prompt, self.overlong = train_on_prompt, overlong
        self.marks_generation = bool(_GENERATION.search(str(tokenizer.chat_template)))
        self.counts = {"conversations": 0, "truncated": 0, "dropped": 0, "loss_tokens": 0}

    def __call__(self, conversations: list[list[dict]]) -> list[Optional[tuple[list[int], list[int]]]]:
        return [self.encode(turns) for turns in conversations]

    def encode(self, turns) -> Optional[tuple[list[int], list[int]]]:
        tools = None
        if isinstance(turns, dict):  # a row that offers tools: the template renders them
            turns, tools = turns["messages"], turns.get("tools")
        try:
            ids, mask = self.render(turns, tools)
        except UserError:
            raise
        except Exception as error:  # the template's own error (raise_exception on a role it does not take, ...)
            raise UserError(Problem("tokenizer.chat_template", f"the chat template fails on row "
                                    f"{self.counts['conversations']} (roles {[t.get('role') for t in turns]}): "
                                    f"{type(error).__name__}: {str(error)[:200]}",
                                    fix="fix or drop that conversation, or use a template that takes it")) from None
        self.counts["conversations"] += 1
        if len(ids) > self.max_length:
            if self.overlong == "drop":
                self.counts["dropped"] += 1
                return None
            self.counts["truncated"] += 1
            ids, mask = ids[:self.max_length], mask[:self.max_length]
        self.counts["loss_tokens"] += sum(mask)
        return ids, mask

    def render(self, turns: list[dict], tools: Optional[list] = None) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if tools:
            tok = _WithTools(tok, tools)
        if self.train_on_prompt:
            ids = tok.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"]
            return list(ids), [1] * len(ids)
        if self.marks_generation:
            out = tok.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        text = tok.apply_chat_template(turns, tokenize=False)
        spans = []
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = tok.apply_chat_template(turns[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = tok.apply_chat_template(turns[:i + 1], tokenize=False)
            if not (text.startswith(before) and text.startswith(upto)):
                raise UserError(Problem("tokenizer.chat_template", "renders a conversation's beginning differently "
                                        "from the whole conversation, so the assistant's tokens cannot be found",
                                        fix="use a template that marks them with {% generation %}, or set "
                                        "data.train_on_prompt=true"))
            spans.append((len(before), len(upto)))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask

    def append(self, writer, part: str, rows: list[int], encoded: list) -> None:
        """Write the chosen rows' ids, masks and ends (a dropped conversation writes nothing)."""
        kept = [encoded[i] for i in rows if encoded[i] is not None]
        if not kept:
            return
        base = writer.count(part)
        ends = np.cumsum([len(ids) for ids, _ in kept]) + base
        writer.append(part, np.concatenate([np.asarray(ids) for ids, _ in kept]),
                      ends=ends.astype(np.int64),
                      mask=np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in kept]))

    def summary(self) -> dict:
        return {"chat": {**self.counts, "max_length": self.max_length}}


class _WithTools:
    """The tokenizer, its chat template given the row's tools at every call."""

    def __init__(self, tokenizer, tools: list):
        self._tokenizer, self._tools = tokenizer, tools

    def apply_chat_template(self, turns, **kwargs):
        return self._tokenizer.apply_chat_template(turns, tools=self._tools, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


def for_data(cfg: RunConfig, tokenizer):
    """The tokenizer with this data's own template (`data.chat_template`, a source's), else as it is."""
    given = cfg.data.chat_template
    if not given:
        return tokenizer
    import copy

    path = Path(given).expanduser()
    own = copy.copy(tokenizer)  # the shared tokenizer keeps its template for the other sources
    own.chat_template = path.read_text() if "{" not in given and path.is_file() else given
    return own


def encoder_for(cfg: RunConfig, tokenizer) -> ChatEncoder:
    d = cfg.data
    return ChatEncoder(for_data(cfg, tokenizer), d.max_length, d.train_on_prompt, d.overlong)


def describe_counts(counts: dict) -> str:
    max_length = counts.get("max_length")
    text = f"{counts['conversations']:,} conversations, {counts['loss_tokens']:,} tokens in the loss"
    if counts["truncated"]:
        text += f"; {counts['truncated']:,} longer than {max_length} tokens truncated (data.overlong)"
    if counts["dropped"]:
        text += f"; {counts['dropped']:,} longer than {max_length} tokens dropped (data.overlong)"
    return text
