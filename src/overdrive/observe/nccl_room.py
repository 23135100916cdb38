"""Room for NCCL to speak before the hang watchdog ends a GPU job.

A collective that never completes is NCCL's to report first: at `launch.timeout_minutes` its
own watchdog names the collective, its sequence number and the ranks that did not join, and
its flight recorder dumps the last collectives of every rank, which says which rank stopped
where. Two things keep that from happening unless asked:

- the flight recorder records nothing while `TORCH_NCCL_TRACE_BUFFER_SIZE` (now also read as
  `TORCH_FR_BUFFER_SIZE`) is unset: it is set for every worker of a GPU job, with the dump on
  timeout written under `<output_dir>/nccl_trace/`;
- overdrive's watchdog (`launch.hang_timeout_s`, 10 minutes) would kill the job before NCCL's
  timeout (60 minutes): on a job over NCCL it waits until that timeout and a minute more.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

TRACE_ENTRIES = 2000  # collectives kept per rank (torch's documented example size)
GRACE_S = 60.0  # after NCCL's timeout: its report and the flight recorder's dump


def over_nccl(cfg: RunConfig, gpus: Optional[int] = None) -> bool:
    """Whether the job's collectives run over NCCL (GPUs, backend auto or nccl)."""
    from overdrive.strategies.cpu import on_cpu

    return not on_cpu(cfg, gpus) and cfg.launch.backend in ("auto", "nccl")


def watchdog_timeout_s(cfg: RunConfig, gpus: Optional[int] = None) -> Optional[float]:
    """The hang watchdog's timeout: `launch.hang_timeout_s`, raised past NCCL's own timeout on
    a job over NCCL (None: no watchdog)."""
    hang = cfg.launch.hang_timeout_s
    if hang is None or not over_nccl(cfg, gpus):
        return hang
    return max(hang, cfg.launch.timeout_minutes * 60 + GRACE_S)


def flight_recorder_env(cfg: RunConfig, gpus: Optional[int] = None) -> dict[str, str]:
    """The workers' variables that turn NCCL's flight recorder on, dumped on timeout."""
    if not over_nccl(cfg, gpus):
        return {}
    prefix = str(Path(str(cfg.output_dir)) / "nccl_trace" / "rank_")
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_ENTRIES), "TORCH_FR_BUFFER_SIZE": str(TRACE_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
            "TORCH_FR_DUMP_TEMP_FILE": prefix}
