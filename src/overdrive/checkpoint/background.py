"""`checkpoint.async`: a checkpoint staged to host memory, written in the background.

Where the strategy saves the model and optimizer through torch.distributed.checkpoint (FSDP2 with
a sharded state dict: `registry.saves_through_dcp`), the save is split in two:

- in the training thread (what training waits for): Accelerate's `save_state` for everything
  but the model and optimizer (schedule, RNG states, samplers: small files), the trainer's
  state, and DCP's `async_save` of the model and of the optimizer, which copies every tensor to
  host memory before it returns. The files are those Accelerate writes itself
  (`pytorch_model_fsdp_0/`, `optimizer_0/`), so `load_state` resumes them as any other.
- in a background thread: DCP writes the staged copies (its own collectives over a gloo group
  of its own, so they never meet the training's), then the main process seals the directory as
  a synchronous save does (store.commit: manifest, fsync, rename) and prunes.

The atomic promise is store.py's: the checkpoint lives in `.tmp-step-N/` until the manifest is
written and the directory renamed, so a kill during the background write leaves the previous
checkpoint the newest complete one; the next save begins by removing that leftover. Before the
next save, and before the run ends, every rank waits for the save in flight and agrees on how it
went (agreed.py): a failure there ends the run with the same message as a synchronous save's.

`OVERDRIVE_FAULT_INJECT=stall:step=K` (config/fault_injection.py) holds the background write of
step K's checkpoint before it is sealed, for a test to kill the job there.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.checkpoint import tensor_parallel
from overdrive.config.schema import RunConfig
from overdrive.strategies import registry


def wanted(cfg: RunConfig) -> bool:
    """`checkpoint.async`, where it applies: a DCP-saving strategy, the whole model trained (an
    adapter run's checkpoint leaves the frozen base out through Accelerate's own hooks)."""
    return bool(getattr(cfg.checkpoint, "async")) and registry.of(cfg).saves_through_dcp(cfg) \
        and cfg.peft.method == "none" and cfg.parallel.pp_size == 1


_slots: list = []


def _slot(index: int) -> tuple[Any, Any]:
    """(process group, stager) of the `index`-th write of a save (the model, the optimizer), made
    once, by every rank at its first save, in the same order, and kept:

    - a gloo group for the write's own collectives (planning, the coordinator's metadata): each
      write runs in its own thread, and two threads' collectives on one group would interleave;
    - a stager whose host buffers are reused save after save (a fresh one allocates and faults in
      the whole state again, most of what staging cost here). Reusing them is safe because a save
      begins only once the one before it is written (`Checkpointer.wait`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    while len(_slots) <= index:
        pinned = torch.cuda.is_available()  # page-locked host memory: faster copies from the GPU
        _slots.append((dist.new_group(backend="gloo"), DefaultStager(StagingOptions(pinned, False, False, False))))
    return _slots[index]


def prepare(writes: int) -> None:
    """The groups and stagers of a save's `writes`, made by every rank before the first step."""
    for index in range(writes):
        _slot(index)


def stage(accelerator: Any, path: Path) -> list:
    """Everything but the model and optimizer written now; those two staged to host memory and
    handed to DCP's async_save. Returns the futures of their background writes."""
    import torch.distributed.checkpoint as dcp
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    models, optimizers = list(accelerator._models), list(accelerator._optimizers)
    with tensor_parallel.set_aside(accelerator):  # Accelerate writes the rest: schedule, RNG, samplers
        accelerator.save_state(str(path))
    options = _prepare_sd_options(accelerator.state.fsdp_plugin)  # the keys and layout Accelerate saves with
    writes = [({"model": _get_model_state_dict(model, adapter_only=False, sd_options=options)},
               f"{FSDP_MODEL_NAME}_{index}") for index, model in enumerate(models)]
    writes += [({"optimizer": get_optimizer_state_dict(models[index], optimizer, options=options)},
                f"{OPTIMIZER_NAME}_{index}") for index, optimizer in enumerate(optimizers)]
    futures = []
    for index, (state, name) in enumerate(writes):
        group, stager = _slot(index)
        futures.append(dcp.async_save(state, checkpoint_id=str(path / name), process_group=group, async_stager=stager))
    return futures


class Pending:
    """One checkpoint being written: DCP's futures, then (main process) the seal."""

    def __init__(self, step: int, tmp: Path, futures: list, seal: Optional[Callable[[], None]],
                 stall: bool = False):
        self.step, self.tmp, self.futures, self.seal, self.stall = step, tmp, futures, seal, stall
        self.started = time.perf_counter()
        self.seconds: Optional[float] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._write, name=f"checkpoint-{step}", daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            for future in self.futures:
                future.result()
            while self.stall:  # the test hook: written, not sealed, until the job is killed
                time.sleep(0.05)
            if self.seal is not None:
                self.seal()
            self.seconds = time.perf_counter() - self.started
        except BaseException as error:  # noqa: BLE001  raised in the training thread by `wait`
            self.error = error

    def wait(self) -> None:
        """Until this rank's part is written (and, on the main process, sealed); its error, raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
