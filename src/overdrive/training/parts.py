"""What the loop is built from: tokenizer, model, data, optimizer and schedule, prepared by
the Accelerator (`build_parts`), and the trained model saved at the end (`save_final`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from overdrive import data as data_mod
import overdrive.config.batch as batch
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.training import model as model_mod
from overdrive.training import telemetry
from overdrive.training.optimization import make_optimizer, make_scheduler
from overdrive.training.tokenizer import build_tokenizer


@dataclass
class Parts:
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    tokenizer: Any
    flops_per_token: float
    peak: telemetry.DevicePeak
    seq_len: int


def _micro_batch(cfg: RunConfig) -> int:
    mbs = cfg.training.micro_batch_size
    if mbs == "auto":
        raise UserError(Problem("training.micro_batch_size", "`auto` must be resolved before the parts are built",
                                fix="train() resolves it (overdrive.training.autobatch); or set an integer"))
    return mbs


def _check_positions(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise UserError(Problem("data.max_length", f"{seq_len} is longer than the model's {limit} positions",
                                fix=f"set data.max_length <= {limit}"))


def build_parts(cfg: RunConfig, accelerator) -> Parts:
    """Tokenizer, model, data, optimizer and schedule, prepared by `accelerator`."""
    from accelerate.utils import set_seed

    t, d = cfg.training, cfg.data
    micro = _micro_batch(cfg)
    split = batch.split(cfg)
    cache_dir = Path(d.cache_dir).expanduser()
    # One process per machine trains the tokenizer and fills the token cache; the others wait
    # for those files (not in a barrier), then every process memory-maps the same token ids.
    tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer, build=accelerator.is_local_main_process,
                                         show=accelerator.is_main_process and cfg.logging.level != "quiet")
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if cfg.model.task == "sequence-classification":
        # The classifier reads the last non-pad token. A causal LM gets no pad id: packed
        # blocks have no padding, and with pad == eos Transformers would warn on every batch.
        special["pad_token_id"] = tokenizer.pad_token_id
    set_seed(t.seed)  # same initial weights on every rank and every run
    model = model_mod.build_model(cfg, vocab_size=len(tokenizer), label_names=tokens.label_names,
                                  special_tokens=special)
    _check_positions(model.config, d.max_length)
    layers, width = model_mod.shape_of(model.config)
    fpt = telemetry.flops_per_token(model_mod.flop_params(model), layers, width, d.max_length)

    collate = data_mod.collate_for(cfg.model.task, tokenizer.pad_token_id)
    train_loader = data_mod.train_loader(tokens.train, split.micro, split.accumulation,
                                         split.data_parallel, t.seed, d.shuffle, d.num_workers,
                                         d.pin_memory, collate)
    eval_loader = None
    if tokens.validation is not None:
        # A fixed leading subset: evaluations are comparable across steps, and the loader is
        # always iterated to its end (leaving it early confuses Accelerate's end-of-data tracking).
        n = min(len(tokens.validation), t.eval_batches * micro * split.data_parallel)
        eval_loader = data_mod.eval_loader(torch.utils.data.Subset(tokens.validation, range(n)), micro,
                                           d.num_workers, d.pin_memory, collate)
    o, s = cfg.optim, cfg.scheduler
    optimizer = make_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.implementation, accelerator.device.type)
    scheduler = make_scheduler(optimizer, s.name, s.warmup_steps, t.max_steps, s.min_lr_ratio)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    model = _maybe_compile(model, cfg, accelerator)
    peak = telemetry.DevicePeak(accelerator.device, cfg.precision.mixed_precision, cache_dir)
    return Parts(accelerator, model, optimizer, scheduler, train_loader, eval_loader, tokenizer, fpt, peak,
                 d.max_length)


def _maybe_compile(model, cfg: RunConfig, accelerator):
    """torch.compile when `compile.backend` is set and the Accelerator has not already done it."""
    c = cfg.compile
    if not c.backend or accelerator.state.dynamo_plugin.backend.value.lower() != "no":
        return model
    return torch.compile(model, backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic)


def save_final(cfg: RunConfig, parts: Parts, out: Path) -> None:
    """The trained model and tokenizer as a `save_pretrained` directory: out/model."""
    acc = parts.accelerator
    acc.wait_for_everyone()
    if not cfg.checkpoint.save_final_model:
        return
    # Every rank takes part: under ZeRO-3 or FSDP the full weights are gathered from shards.
    state_dict = acc.get_state_dict(parts.model)
    if acc.is_main_process:
        from transformers.utils import logging as hf_logging

        target = out / "model"
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is only noise
        try:
            acc.unwrap_model(parts.model).save_pretrained(target, state_dict=state_dict, save_function=acc.save)
            parts.tokenizer.save_pretrained(target)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
    acc.wait_for_everyone()
