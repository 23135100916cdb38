"""`training.oom_retry`: an out-of-memory step redone at half the micro-batch, same global batch.

Memory use moves during a run (a long batch, fragmentation, an evaluation), so the micro-batch
found before step 1 can stop fitting. On an out-of-memory error inside a step every rank agrees
that the step failed, drops what the step held, halves the micro-batch and doubles the
accumulation, and redoes the step from its first sample:

- the global batch is unchanged (micro x accumulation x data-parallel ranks), the loader is
  rebuilt at the new micro-batch over the same sampler, and the data position rewound to the
  step's first sample in the new units: the step takes the same samples, in the order a run
  started at the new micro-batch takes them, and its loss is normalised by the same global
  count (step_loss.py);
- the new split is kept: the loop, the checkpoint and resolved.json (origin `oom_retry`) read
  it, metrics.jsonl records it, and a resume of a checkpoint saved at it starts at it
  (checkpoint/resume.py);
- at micro-batch 1 there is nothing left to halve: the run ends with a message saying so.

Agreeing is one collective per micro-batch (an int, just before its backward), only when the
feature is on and there are several processes. A rank whose forward ran out of memory enters
that agreement from its handler; the others reach it before their backward, learn of the
failure and stop the step too. An out-of-memory error inside a backward that reduces gradients
over ranks cannot be agreed on (the other ranks are inside that reduction): with several
processes it ends the run as before. So the feature is refused where a forward itself holds
collectives (sharded parameters, tensor, context or pipeline parallel; resolving/validate.py).

`OVERDRIVE_FAULT_INJECT=oom:step=K:rank=R` (config/fault_injection.py) raises the error on
rank R after the forward of step K's first micro-batch, once.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

import overdrive.config.batch as batch
from overdrive.config.fault_injection import Injection
from overdrive.config.provenance import Origin
from overdrive.config.schema import RunConfig
from overdrive.resolving import Resolved
from overdrive.errors import Problem, UserError


def recorded(resolved: Resolved, cfg: RunConfig) -> Resolved:
    """`resolved` running `cfg`, the split's two keys with their origin (for resolved.json)."""
    why = Origin("oom_retry", "training.oom_retry: halved after an out-of-memory step, the global batch kept")
    return replace(resolved, config=cfg, origins={**resolved.origins, "training.micro_batch_size": why,
                                                  "training.gradient_accumulation_steps": why})


class _OtherRankFailed(Exception):
    """Another rank ran out of memory in this step: this one stops the step too."""


def is_out_of_memory(error: BaseException) -> bool:
    from overdrive.memory import mentions_out_of_memory

    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError)
                                                         and mentions_out_of_memory(str(error)))


def smaller_split(micro: int, accumulation: int) -> Optional[tuple[int, int]]:
    """The next (micro, accumulation) down with the same samples per rank and step: half the
    micro-batch when it is even, else its largest divisor below it; None at micro-batch 1."""
    smaller = next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)
    return None if smaller is None else (smaller, accumulation * (micro // smaller))


@dataclass
class _Mark:
    """Where the loop was when the step began: put back before the step is redone."""

    epoch: int
    batch_in_epoch: int
    tokens_seen: int
    micro_steps: int
    loss_sum: torch.Tensor
    loss_tokens: torch.Tensor


class OomRetry:
    """Runs the loop's step, redoing it at a smaller split when it runs out of memory.

    `loop` is training/loop.Loop: its config, split, state, data iterator and accelerator are
    what a new split changes. `on_new_config(cfg)` records the config that now runs."""

    def __init__(self, loop: Any, injection: Injection, on_new_config: Callable[[RunConfig], None]):
        self.loop, self.on_new_config = loop, on_new_config
        self.enabled = loop.cfg.training.oom_retry
        acc = loop.parts.accelerator
        # Off, it neither agrees nor injects: the step runs as it would without it.
        self.rank, self.world = (acc.process_index, acc.num_processes) if self.enabled else (0, 1)
        self.inject_at = injection.oom_step if injection.oom_rank == self.rank else None
        self.backward_failed = False  # this attempt's error came out of a backward
        self.retries = 0

    # -------------------------------------------------------------- the step, guarded

    def run(self, step: Callable[[], None]) -> None:
        if not self.enabled:
            return step()
        while True:
            mark = self._mark()
            self.backward_failed = False
            try:
                return step()
            except _OtherRankFailed:
                pass
            except Exception as error:  # noqa: BLE001  judged here: only out-of-memory is retried
                if not is_out_of_memory(error) or (self.backward_failed and self.world > 1):
                    raise
                self._agree(failed=True)  # the handler's end lets go of the traceback and the step's tensors
            self._retry(mark)

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        """The loop's backward: agreed on first (several processes), then run."""
        if self.enabled:
            state = self.loop.state
            if self.inject_at == state.step + 1:
                self.inject_at = None  # once: the redone step is not failed again
                raise torch.OutOfMemoryError(f"OVERDRIVE_FAULT_INJECT: out of memory injected in step "
                                             f"{state.step + 1} on rank {self.rank}")
            if self._agree(failed=False):
                raise _OtherRankFailed()
        try:
            accelerator.backward(loss)
        except BaseException:
            self.backward_failed = True
            raise

    def _agree(self, failed: bool) -> bool:
        """Did any rank fail this step? One all-reduce of an int, every rank at the same point."""
        if self.world == 1:
            return failed
        acc = self.loop.parts.accelerator
        flag = torch.tensor(int(failed), device=acc.device)
        return bool(acc.reduce(flag, "max").item())

    # -------------------------------------------------------------- the new split

    def _mark(self) -> _Mark:
        s = self.loop.state
        return _Mark(s.epoch, s.batch_in_epoch, s.tokens_seen, s.micro_steps, s.loss_sum.clone(),
                     self.loop.loss_tokens.count.clone())

    def _free(self) -> None:
        loop = self.loop
        loop.parts.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _retry(self, mark: _Mark) -> None:
        loop = self.loop
        self._free()
        t = loop.cfg.training
        smaller = smaller_split(int(t.micro_batch_size), t.gradient_accumulation_steps)
        if smaller is None:
            raise UserError(Problem("training.micro_batch_size", f"step {loop.state.step + 1} ran out of memory at "
                                    "micro-batch 1: training.oom_retry has nothing left to halve",
                                    fix="shard more (parallel.strategy=fsdp or deepspeed), turn on "
                                        "model.gradient_checkpointing, or lower data.max_length; "
                                        "`overdrive plan` shows the memory each choice needs"))
        micro, accumulation = smaller
        before = int(t.micro_batch_size)
        cfg = loop.cfg.model_copy(update={"training": t.model_copy(update={
            "micro_batch_size": micro, "gradient_accumulation_steps": accumulation})})
        self.retries += 1
        state = loop.state
        state.epoch, state.tokens_seen, state.micro_steps = mark.epoch, mark.tokens_seen, mark.micro_steps
        state.batch_in_epoch = mark.batch_in_epoch * (before // micro)  # the same samples, in the new units
        state.loss_sum.copy_(mark.loss_sum)
        loop.loss_tokens.count.copy_(mark.loss_tokens)
        loop.spikes.step_loss = None  # training.loss_spike sums the step's loss afresh
        self._new_loader(micro)
        acc = loop.parts.accelerator
        acc.gradient_accumulation_steps = accumulation
        acc.step = 0  # Accelerate counts micro-batches to the accumulation's end: the step starts again
        loop.cfg, loop.split, loop.ckpt.cfg = cfg, batch.split(cfg), cfg  # what every later step and save reads
        self.on_new_config(cfg)
        step = state.step + 1
        loop.progress.print(f"step {step}: out of memory at micro-batch {before}; redoing it at micro-batch {micro} "
                            f"x accumulation {accumulation} (the same global batch; training.oom_retry)")
        loop.metrics.write({"step": step, "oom_retry": self.retries, "micro_batch_size": micro,
                            "gradient_accumulation_steps": accumulation, "time": time.time()})

    def _new_loader(self, micro: int) -> None:
        """The training loader at `micro`, over the same data set, sampler and collation, prepared
        as the first was; the loop draws from it at the rewound position."""
        from overdrive.training.loop_state import batches

        loop = self.loop
        acc, old = loop.parts.accelerator, loop.parts.train_loader
        base_sampler = old.batch_sampler
        while hasattr(base_sampler, "batch_sampler"):  # Accelerate's shard around the torch batch sampler
            base_sampler = base_sampler.batch_sampler
        loader = torch.utils.data.DataLoader(
            old.dataset, batch_size=micro, sampler=base_sampler.sampler, drop_last=True,
            num_workers=old.num_workers, pin_memory=old.pin_memory, collate_fn=old.collate_fn,
            persistent_workers=old.num_workers > 0, generator=old.generator)
        prepared = acc.prepare_data_loader(loader)
        acc._dataloaders = [d for d in acc._dataloaders if d is not old]  # what save_state walks
        loop.parts.train_loader = prepared
        loop.data = batches(prepared, loop.state, acc.skip_first_batches)
