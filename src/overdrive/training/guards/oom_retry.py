"""`training.oom_retry`: an out-of-memory step redone at half the micro-batch, same global batch.

Memory use moves during a run (a long batch, fragmentation, an evaluation), so the micro-batch
found before step 1 can stop fitting. On an out-of-memory error inside a step every rank agrees
that the step failed, and the guard returns its decision (`Redo`: half the micro-batch, twice the
accumulation); the loop applies it (training/loop.py: drops what the step held, puts its state,
metric sums and data position back, rebuilds the loader and tells the objective the new split,
training/build/parts.py's `Parts.resplit`) and redoes the step from its first sample:

- the global batch is unchanged (micro x accumulation x data-parallel ranks), the loader is
  rebuilt at the new micro-batch over the same sampler, and the data position rewound to the
  step's first sample in the new units: the step takes the same samples, in the order a run
  started at the new micro-batch takes them, and its loss is normalised by the same global
  count (step_loss.py);
- the new split is kept: the loop, the checkpoint and resolved.json (origin `oom_retry`) read
  it, metrics.jsonl records it, and a resume of a checkpoint saved at it starts at it
  (checkpoint/resume.py);
- at micro-batch 1 there is nothing left to halve: the run ends with a message saying so.

Without the key an out-of-memory step ends the run by key (`training.oom_retry`, exit 2, no
traceback), naming the fixes; the step never reached the optimizer, so the last checkpoint is
the run's state.

Agreeing is one collective per micro-batch (an int, just before its backward), only when the
feature is on and there are several processes. A rank whose forward ran out of memory enters
that agreement from its handler; the others reach it before their backward, learn of the
failure and stop the step too. An out-of-memory error inside a backward that reduces gradients
over ranks cannot be agreed on (the other ranks are inside that reduction): with several
processes it ends the run as before. So the feature is refused where a forward itself holds
collectives (sharded parameters, tensor, context or pipeline parallel; resolving/validate.py).

An online objective samples before its loss (GRPO's completions, on-policy distillation's), each rank
alone, and then gathers what it sampled (GRPO's rewards) or counts the step's units over the ranks:
collectives a failed rank would never join. So the sampling runs under `alone`: an out-of-memory
error in it is agreed on at its end, every rank at the same point, and the step redone as above.
The objective samples in smaller batches after such a failure (GRPO halves its generation batch;
on-policy distillation samples a micro-batch at a time, which the redo halves).

`OVERDRIVE_FAULT_INJECT=oom:step=K:rank=R` (config/fault_injection.py) raises the error on
rank R after the forward of step K's first micro-batch, once, with the key on or off;
`oom-sampling:step=K:rank=R` raises it while rank R samples in step K.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, TypeVar

import torch

from overdrive.config.batch import BatchSplit
from overdrive.config.fault_injection import Injection
from overdrive.config.provenance import Origin
from overdrive.config.schema import RunConfig
from overdrive.resolving import Resolved
from overdrive.errors import Problem, UserError


T = TypeVar("T")


def recorded(resolved: Resolved, cfg: RunConfig) -> Resolved:
    """`resolved` running `cfg`, the split's two keys with their origin (for resolved.json)."""
    why = Origin("oom_retry", "training.oom_retry: halved after an out-of-memory step, the global batch kept")
    return replace(resolved, config=cfg, origins={**resolved.origins, "training.micro_batch_size": why,
                                                  "training.gradient_accumulation_steps": why})


class _AgreedFailure(Exception):
    """A rank ran out of memory in this step and the ranks agreed on it: this one stops the step too."""


def is_out_of_memory(error: BaseException) -> bool:
    from overdrive.memory import mentions_out_of_memory

    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError)
                                                         and mentions_out_of_memory(str(error)))


def smaller_split(micro: int, accumulation: int) -> Optional[tuple[int, int]]:
    """The next (micro, accumulation) down with the same samples per rank and step: half the
    micro-batch when it is even, else its largest divisor below it; None at micro-batch 1."""
    smaller = next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)
    return None if smaller is None else (smaller, accumulation * (micro // smaller))


@dataclass(frozen=True)
class Redo:
    """The guard's decision after an out-of-memory step: redo it at this split (the loop applies it)."""

    micro: int
    accumulation: int


_SAVE_MEMORY = ("shard more (parallel.strategy=fsdp or deepspeed), turn on model.gradient_checkpointing, "
                "or lower data.max_length; `overdrive plan` shows the memory each choice needs")


def out_of_memory(step: int, micro: int, why: str = "") -> UserError:
    """The run's end after an out-of-memory step it cannot redo: by key, with the fixes."""
    if why:
        return UserError(Problem("training.oom_retry", f"step {step} ran out of memory at micro-batch {micro}: {why}",
                                 fix=f"lower training.micro_batch_size (or set it to auto); or {_SAVE_MEMORY}"))
    return UserError(Problem("training.oom_retry", f"step {step} ran out of memory at micro-batch {micro} "
                             "(training.oom_retry is off); the last checkpoint holds the run up to the step before",
                             fix="set training.oom_retry=true to redo such a step at half the micro-batch (the global "
                                 "batch kept), or lower training.micro_batch_size (or set it to auto)"))


class OomRetry:
    """Runs the loop's step and judges an out-of-memory error in it: `attempt` returns None when
    the step went through, a `Redo` when it is to be redone at a smaller split."""

    def __init__(self, cfg: RunConfig, accelerator: Any, injection: Injection):
        self.enabled = cfg.training.oom_retry
        self.accelerator = accelerator
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        # The hook fires with the key on or off: a run without it shows how it ends.
        self.inject_at = injection.oom_step if injection.oom_rank == self.rank else None
        self.inject_sampling_at = injection.sampling_oom_step if injection.sampling_oom_rank == self.rank else None
        self.backward_failed = False  # this attempt's error came out of a backward
        self.step = 0  # the step being attempted (1-based)
        self.retries = 0

    # -------------------------------------------------------------- the step, guarded

    def attempt(self, step: Callable[[], None], split: BatchSplit, number: int) -> Optional[Redo]:
        """Run `step` (optimizer step `number` at `split`); the decision when it ran out of memory."""
        self.step, self.backward_failed = number, False
        try:
            step()
            return None
        except _AgreedFailure:
            pass
        except Exception as error:  # noqa: BLE001  judged here: only out-of-memory is retried
            if not is_out_of_memory(error):
                raise
            if not self.enabled:
                raise out_of_memory(number, split.micro) from None
            if self.backward_failed and self.world > 1:
                raise out_of_memory(number, split.micro, "inside a backward that reduces gradients over "
                                    f"{self.world} processes, where the ranks cannot agree to redo it") from None
            self._agree(failed=True)  # the handler's end lets go of the traceback and the step's tensors
        smaller = smaller_split(split.micro, split.accumulation)
        if smaller is None:
            raise UserError(Problem("training.micro_batch_size", f"step {number} ran out of memory at micro-batch 1: "
                                    "training.oom_retry has nothing left to halve", fix=_SAVE_MEMORY))
        self.retries += 1
        return Redo(*smaller)

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        """The loop's backward: agreed on first (several processes, the key on), then run."""
        if self.inject_at == self.step:
            self.inject_at = None  # once: the redone step is not failed again
            raise torch.OutOfMemoryError(f"OVERDRIVE_FAULT_INJECT: out of memory injected in step "
                                         f"{self.step} on rank {self.rank}")
        if self.enabled and self._agree(failed=False):
            raise _AgreedFailure()
        try:
            accelerator.backward(loss)
        except BaseException:
            self.backward_failed = True
            raise

    def alone(self, work: Callable[[], T]) -> T:
        """`work` that this rank does without the others (an online objective's sampling), with the collectives
        that follow it in mind: an out-of-memory error in it is agreed on at its end (several processes, the key
        on), so a rank that failed and the ranks that did not all stop the step there, before any of them enters
        a collective the failed one would never reach."""
        failed = False
        try:
            if self.inject_sampling_at == self.step:
                self.inject_sampling_at = None  # once: the redone step samples in full
                raise torch.OutOfMemoryError(f"OVERDRIVE_FAULT_INJECT: out of memory injected while step {self.step} "
                                             f"samples on rank {self.rank}")
            result = work()
        except Exception as error:  # noqa: BLE001  judged here: only out-of-memory is agreed on
            if not (self.enabled and self.world > 1 and is_out_of_memory(error)):
                raise  # one process, or the key off: attempt() judges it as it judges a step's
            failed = True  # the handler's end lets go of the traceback and what the sampling held
        if self._agree(failed):
            raise _AgreedFailure()
        return result

    def _agree(self, failed: bool) -> bool:
        """Did any rank fail this step? One all-reduce of an int, every rank at the same point."""
        if not self.enabled or self.world == 1:
            return failed
        flag = torch.tensor(int(failed), device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item())
