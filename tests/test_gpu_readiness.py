"""GPU paths read against the libraries, checked here without a GPU: what preflight does before
NCCL starts, the combinations refused by key before a GPU job starts, MFU's peak, NCCL's room
before the watchdog, step phases and the profiler on the device's clock (the loop's own paths:
test_gpu_readiness_loop.py).

The CUDA side is mocked where a CPU cannot run it (as in test_gpu_paths.py); the libraries'
own objects are used everywhere else.
"""

from __future__ import annotations

import pytest
from conftest import cfg_of
import torch

from overdrive.errors import UserError


def keys_of(error: UserError) -> list[str]:
    return [p.key for p in error.problems]


# ------------------------------------------------------------------ refused by key before a job starts


CP_GPU_JOB = ("parallel.strategy=fsdp", "parallel.cp_size=2", "launch.num_processes=8", "data.max_length=64")


@pytest.mark.parametrize("items, key", [
    ((*CP_GPU_JOB, "data.format=chat", "data.packing=true", "model.name_or_path=some/model"), "data.packing"),
    ((*CP_GPU_JOB, "model.task=sequence-classification"), "parallel.cp_size"),
    (("precision.mixed_precision=fp8", "peft.method=qlora", "model.name_or_path=some/model"), "precision.mixed_precision"),
    (("precision.mixed_precision=fp8", "precision.fp8.backend=MSAMP", "parallel.strategy=fsdp"), "precision.fp8.backend"),
    (("parallel.strategy=fsdp", "parallel.tp_size=2", "launch.num_processes=4", "peft.method=lora",
      "model.name_or_path=some/model"), "parallel.tp_size"),
])
def test_gpu_combinations_that_would_run_wrongly_are_refused_by_key(items, key):
    with pytest.raises(UserError) as error:
        cfg_of(*items)
    assert key in keys_of(error.value), str(error.value)
    # The same job without the combination is accepted (packing off, MS-AMP under DeepSpeed, ...).


def test_context_parallel_without_packing_and_ms_amp_under_deepspeed_are_accepted():
    cfg_of(*CP_GPU_JOB, "data.format=chat", "data.packing=false", "model.name_or_path=some/model")
    from overdrive.strategies.library_features import msamp_supported

    if msamp_supported():  # an Accelerate without MS-AMP refuses it by key (tests/test_tested_versions.py)
        cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=MSAMP", "parallel.strategy=deepspeed")
    cfg_of("parallel.strategy=fsdp", "parallel.tp_size=2", "launch.num_processes=4")


# ------------------------------------------------------------------ preflight on a machine with GPUs


@pytest.mark.parametrize("backend", [None, "cuda:nccl,cpu:gloo"])
def test_preflight_takes_its_local_rank_s_gpu_before_nccl_starts_and_measures_nccl(backend, monkeypatch):
    import torch.distributed as dist

    from overdrive.observe import preflight
    from overdrive.strategies import cpu

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))
    monkeypatch.setattr(cpu, "process_group_backend", lambda cfg: backend)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    rank, world, device = preflight.join_process_group(cfg_of("launch.num_processes=8"))
    assert calls == [("set_device", torch.device("cuda", 3)), ("init", backend or "nccl")]
    assert (rank, world, device) == (3, 8, torch.device("cuda", 3))  # NCCL measured, not gloo on the CPU


# ------------------------------------------------------------------ MFU against the peak of the dtype used


def test_mfu_is_read_against_the_peak_of_the_precision_the_matmuls_run_in():
    from overdrive.training.build.dtypes import matmul_precision
    from overdrive.training.telemetry import gpu_peak_flops

    bf16_weights = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert matmul_precision("no", bf16_weights) == "bf16"
    assert matmul_precision("no", torch.nn.Linear(8, 8).half()) == "fp16"
    assert matmul_precision("no", torch.nn.Linear(8, 8)) == "no"
    assert matmul_precision("bf16", torch.nn.Linear(8, 8)) == "bf16"  # autocast decides
    h100 = "NVIDIA H100 80GB HBM3"
    # The fp32 peak would make a bf16-weights run's MFU 15x too high.
    assert gpu_peak_flops(h100, matmul_precision("no", bf16_weights)) / gpu_peak_flops(h100, "no") > 14


# ------------------------------------------------------------------ NCCL's timeout speaks before the watchdog


def test_a_job_over_nccl_records_collectives_and_the_watchdog_waits_past_nccl_s_timeout(monkeypatch):
    from overdrive.launch import workers
    from overdrive.launch.process import process_env
    from overdrive.observe import nccl_room, watchdog

    gpu_job = cfg_of("launch.num_processes=16", "launch.num_machines=2", "launch.main_process_ip=node0",
                     "launch.gpus_per_machine=8", "output_dir=/data/run")
    env = process_env(gpu_job, elsewhere=True)  # what an sbatch script or a pod gets
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith("/data/run/nccl_trace/")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in process_env(cfg_of("launch.use_cpu=true"), elsewhere=True)
    # NCCL times out at launch.timeout_minutes (60): the watchdog (600 s) waits past it.
    assert nccl_room.watchdog_timeout_s(gpu_job, gpus=8) == 3600 + nccl_room.GRACE_S
    assert nccl_room.watchdog_timeout_s(gpu_job, gpus=0) == 600  # gloo: the watchdog as configured
    # The launcher hands the watchdog the raised timeout on a GPU machine.
    seen = []

    class Recording:
        def __init__(self, output_dir, timeout_s, processes, say, over_nccl=False):
            seen.append((timeout_s, over_nccl))
            self.hang = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(watchdog, "Watchdog", Recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert workers.watched(gpu_job, lambda: 0) == (0, False) and seen == [(3660.0, True)]


# ------------------------------------------------------------------ step phases on the device's clock


class _DeviceTimeline:
    """CUDA events on a device timeline this test moves by hand."""

    def __init__(self):
        self.now_ms = 0.0

    def event(self):
        at = self.now_ms

        class Event:
            time_ms = at

            def elapsed_time(self, end):
                return end.time_ms - self.time_ms

            def synchronize(self):
                pass

        return Event()


def test_on_cuda_the_phases_are_timed_by_the_device_not_by_when_work_was_queued():
    from overdrive.observe.device_steps import DeviceStepRecorder, recorder_for
    from overdrive.observe.steps import StepRecorder

    host = iter(x * 0.001 for x in range(100))  # the host queues everything within milliseconds
    timeline = _DeviceTimeline()
    recorder = DeviceStepRecorder(clock=lambda: next(host), event=timeline.event)
    for phase, device_ms in (("data", 0.0), ("forward", 5.0), ("backward", 300.0), ("optimizer", 600.0),
                             ("sync", 50.0)):
        timeline.now_ms += device_ms  # the device reaches this phase change this much later
        recorder.enter(phase)
    timeline.now_ms += 5.0
    recorder.step_done(1)
    per_step = recorder.read().per_step()
    assert per_step["forward_s"] == pytest.approx(0.300) and per_step["backward_s"] == pytest.approx(0.600)
    assert per_step["optimizer_s"] == pytest.approx(0.050) and per_step["sync_s"] == pytest.approx(0.005)
    step = sum(per_step[f"{p}_s"] for p in ("data", "forward", "backward", "optimizer", "sync"))
    assert step == pytest.approx(0.960)  # the device's step (0 to 960 ms), phases adding up to it
    assert isinstance(recorder_for(torch.device("cuda", 0)), DeviceStepRecorder)
    assert type(recorder_for(torch.device("cpu"))) is StepRecorder


# ------------------------------------------------------------------ the profiler reads the device on CUDA


def _event(name, start, end, thread=1, device_type=None):
    from types import SimpleNamespace as NS

    return NS(name=name, thread=thread, time_range=NS(start=start, end=end), device_type=device_type)


def test_the_profiler_counts_nccl_kernels_overlapped_by_compute_as_hidden_and_staging_copies_as_no_communication():
    from overdrive.observe.profiling import collective_seconds_by_phase

    cuda = "DeviceType.CUDA"
    events = [_event("phase:forward", 0, 100), _event("phase:backward", 100, 200), _event("phase:optimizer", 200, 210),
              # the host queued everything early; the device runs behind it
              _event("ampere_sgemm", 50, 250, device_type=cuda),
              _event("ncclDevKernel_ReduceScatter_Sum_f32", 150, 250, device_type=cuda),  # overlapped: hidden
              _event("ncclDevKernel_AllGather_RING", 260, 300, device_type=cuda),  # alone: exposed, launched in optimizer
              _event("nccl:all_reduce", 120, 125)]  # the host-side record of a collective: not the device's time
    seconds = collective_seconds_by_phase(events)
    assert seconds == {"forward": 0.0, "backward": 0.0, "optimizer": pytest.approx(40e-6)}
    # On CPU processes: FSDP2's host staging copy is not communication; a send is.
    host = [_event("phase:forward", 0, 100), _event("FSDP::all_gather_copy_in", 0, 30), _event("gloo:send", 40, 60, 7)]
    assert collective_seconds_by_phase(host)["forward"] == pytest.approx(20e-6)


# ------------------------------------------------------------------ the watchdog over NCCL


def test_over_nccl_the_watchdog_does_not_single_out_a_rank_by_its_host_phase():
    import time as clock

    from overdrive.observe.heartbeat import Beat
    from overdrive.observe.watchdog import RankView, judge, render

    def view(rank, phase):
        beat = Beat(rank=rank, local_rank=rank, host="a", pid=100 + rank, step=10, phase=phase, phase_since=0.0,
                    progress=1, written=clock.time(), grads_ready_s_ago=None)
        return RankView(beat, silent_s=0.5, still_s=30)

    # Rank 1's host is in `optimizer`, queued behind an all-reduce its GPU waits in; rank 0's in `sync`.
    views = [view(0, "sync"), view(1, "optimizer")]
    assert [v.beat.rank for v in judge(views, 2, 20).stuck] == [1]  # on gloo the host phase tells
    hang = judge(views, 2, 20, over_nccl=True)
    assert [v.beat.rank for v in hang.stuck] == [0, 1] and hang.waiting == []
    assert "nccl_trace" in render(hang, {})


def test_tensor_parallel_from_pretrained_weights_warns_of_a_whole_copy_per_rank():
    from overdrive.resolving import resolve

    items = ["parallel.strategy=fsdp", "parallel.tp_size=2", "launch.num_processes=4"]
    warned = resolve([], cli=[*items, "model.name_or_path=some/model"], env={}).warnings
    assert [w.key for w in warned if "whole checkpoint" in w.message] == ["parallel.tp_size"]
    assert not [w for w in resolve([], cli=items, env={}).warnings if "whole checkpoint" in w.message]
