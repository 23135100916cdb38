"""A run's corpora opened: the train split and validation (a split of its own or a hold-out),
plain text or rows as stored (sources.py), conversations rendered as chat (chat.py)."""

from __future__ import annotations

from overdrive.config.schema import RunConfig
from overdrive.data.chat import ChatRows
from overdrive.data.sources import Rows, Splits, holdout_fraction, read_source
from overdrive.errors import Problem, UserError


def open_source(cfg: RunConfig, split: str, key: str):
    """The corpus of one split of `data.source` (conversations with `data.format: chat`)."""
    corpus = read_source(cfg, split, key)
    if cfg.data.format not in ("chat", "preference"):
        return corpus
    if not isinstance(corpus, Rows):
        raise UserError(Problem("data.format", f"chat needs rows of conversations; {cfg.data.source!r} is plain text",
                                fix="give a jsonl, json, csv or parquet file (or a data set) with a messages "
                                "column or prompt/completion columns"))
    if cfg.data.format == "preference":
        from overdrive.data.preference import PreferenceRows

        return PreferenceRows(corpus, cfg)
    return ChatRows(corpus, cfg)



def _check_columns(corpus, cfg: RunConfig) -> None:
    if not isinstance(corpus, Rows):
        return
    names = corpus.column_names()
    for key, column in (("data.text_column", corpus.text_column), ("data.label_column", corpus.label_column)):
        if column is not None and column not in names:
            raise UserError(Problem(key, f"no column {column!r}; the data has {names}", fix=f"set {key} to one of those"))


def open_splits(cfg: RunConfig) -> Splits:
    """Builder: config -> the train corpus, and validation as a separate split or a hold-out."""
    d = cfg.data
    if cfg.model.task == "sequence-classification" and d.source == "stdlib":
        raise UserError(Problem("data.source", "the standard-library corpus has no labels for classification",
                                fix="set data.source to a labelled data set (and data.label_column)"))
    train = open_source(cfg, d.split, "data.split")
    _check_columns(train, cfg)
    validation = open_source(cfg, d.validation_split, "data.validation_split") if d.validation_split else None
    if validation is not None:
        _check_columns(validation, cfg)
    holdout = holdout_fraction(cfg)
    label = d.label_column if cfg.model.task == "sequence-classification" else None
    return Splits(train, validation, holdout, cfg.training.seed, d.max_bytes, label)
