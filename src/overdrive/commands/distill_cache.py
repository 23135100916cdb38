"""`overdrive distill-cache [FILE|KEY=VALUE ...]`: the teacher's top-k (`distill.top_k`) over the
run's token data, computed once and stored beside the token cache (data/teacher_cache.py), so that
`overdrive train` with the same teacher, data, tokenizer, data.max_length and distill.top_k reads it
and never loads the teacher. One process, on the first GPU when there is one; resumable: a cache
stopped part way keeps its whole shards and the next call continues after them."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Callable

from overdrive.commands.arguments import add_config_arguments, resolved_from

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--batch-rows", type=int, default=8, metavar="N",
                        help="rows the teacher scores at once (default: 8)")


def run(args: argparse.Namespace) -> int:
    from overdrive.errors import Problem, UserError

    cfg = resolved_from(args).config
    d = cfg.distill
    if d.teacher is None or not d.top_k:
        raise UserError(Problem("distill.top_k" if d.teacher else "distill.teacher",
                                "the cache holds a teacher's top-k: it needs distill.teacher and distill.top_k > 0",
                                fix="set distill.teacher and distill.top_k (e.g. distill.top_k=64)"))
    if args.batch_rows < 1:
        raise UserError(Problem("--batch-rows", f"must be at least 1 (got {args.batch_rows})", fix="e.g. --batch-rows 8"))
    written, path = fill(cfg, args.batch_rows, show=lambda line: print(line, file=sys.stderr))
    print(f"{'wrote' if written else 'already complete:'} {path}", file=sys.stderr)
    return 0


def fill(cfg: RunConfig, batch_rows: int, show: Callable[[str], None] = lambda _: None) -> tuple[int, object]:
    """(shards written, the entry's directory): the teacher's top-k of every train and validation row."""
    import torch

    from overdrive import data as data_mod
    from overdrive.data import teacher_cache
    from overdrive.hf.teacher import fit_problems
    from overdrive.training.objectives import distill, distill_loss
    from overdrive.training.build.tokenizer import build_tokenizer

    from overdrive.errors import UserError

    found = fit_problems(cfg)
    if found:
        raise UserError(found)
    tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer, build=True, show=True)
    path, rows = distill.cache_entry(cfg, tokenizer, [tokens.train, tokens.validation])
    if teacher_cache.complete(path):
        return 0, path
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    show(f"loading the teacher ({cfg.distill.teacher}) on {device}")
    teacher = distill.load_teacher(cfg, device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    collate = data_mod.collate_for(data_mod.sample_kind(cfg), pad, cfg.data.max_length)
    collate = collate or (lambda samples: {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]})

    def score(samples: list[dict]) -> list[tuple]:
        batch = collate(samples)
        inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            ids, logprobs = distill_loss.top_k(teacher(**inputs, use_cache=False).logits, cfg.distill.top_k)
        return [(ids[i, :n], logprobs[i, :n]) for i, n in enumerate(teacher_cache.row_lengths(batch))]

    started = time.perf_counter()
    teacher_name = cfg.distill.teacher
    assert teacher_name is not None, "run() refuses a config without distill.teacher"
    meta = {"teacher": teacher_name, "top_k": cfg.distill.top_k, "max_length": cfg.data.max_length,
            "teacher_files": teacher_cache.teacher_fingerprint(teacher_name)}
    written = teacher_cache.write(path, rows, score, meta, batch_rows, show)
    show(f"{len(rows)} rows in {time.perf_counter() - started:.1f}s")
    return written, path
