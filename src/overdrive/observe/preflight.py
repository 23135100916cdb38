"""`overdrive preflight`, the part that runs in every worker: the checks a job needs before
hours of an allocation go into it, measured through the job's own launcher and rendezvous.

Each rank: joins the process group (the rendezvous completes), measures all-reduce and
all-gather of a gradient-bucket-sized buffer and the latency of a tiny all-reduce, reads a
token rank 0 wrote into output_dir (shared?), checks free disk for a checkpoint, and sends
its host, library versions and resolved config to rank 0, which compares them. The result
goes to `<output_dir>/observe/preflight.machine<M>.json`, which each machine's launcher
prints (preflight_report.py).
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overdrive.observe.heartbeat import directory

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# DDP's default gradient bucket (bucket_cap_mb=25), the unit its all-reduces move.
BUCKET_BYTES = 25 * 2**20
LIBRARIES = ("torch", "accelerate", "deepspeed", "transformers", "overdrive")
# Keys that differ between machines by design.
PER_MACHINE_KEYS = ("launch.machine_rank",)


def result_path(output_dir: str | Path, machine_rank: int) -> Path:
    return directory(output_dir) / f"preflight.machine{machine_rank}.json"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def model_params(cfg: RunConfig) -> int:
    from overdrive.memory.model_shape import Source, hf_config_for_run, model_shape

    return model_shape(Source(hf_config_for_run(cfg), "model", run=cfg, task=cfg.model.task,
                              attn_implementation=cfg.model.attn_implementation)).params


def _timed(op, repeats: int) -> float:
    """Median seconds of `op` (a collective), after one warm-up call."""
    op()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_collectives(world: int, bucket_bytes: int, device) -> dict[str, float]:
    """Bus bandwidth (bytes/s, as nccl-tests define it) of all-reduce and all-gather of one
    bucket, and the latency of an 8-byte all-reduce."""
    import torch
    import torch.distributed as dist

    numel = max(bucket_bytes // 4, 1)
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(max(numel // world, 1), dtype=torch.float32, device=device)
    gathered = torch.empty(shard.numel() * world, dtype=torch.float32, device=device)
    tiny = torch.ones(2, dtype=torch.float32, device=device)

    def sync(op):
        def run():
            op()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    reduce_s = _timed(sync(lambda: dist.all_reduce(buffer)), 5)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather_s = _timed(sync(lambda: gather(gathered, shard)), 5)
    latency_s = _timed(sync(lambda: dist.all_reduce(tiny)), 20)
    nbytes = numel * 4
    # nccl-tests PERFORMANCE.md: busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather.
    return {"bucket_bytes": nbytes, "all_reduce_s": reduce_s, "all_gather_s": gather_s, "latency_s": latency_s,
            "all_reduce_busbw": nbytes / reduce_s * 2 * (world - 1) / world,
            "all_gather_busbw": gathered.numel() * 4 / gather_s * (world - 1) / world}


def step_traffic_bytes(cfg: RunConfig, params: int, world: int) -> float:
    """Bytes each rank moves per optimizer step (bus bytes): the gradient reduction, plus
    the parameter all-gathers (forward and backward) of a strategy that shards parameters."""
    from overdrive.strategies import registry

    grad_bytes = params * (2 if cfg.precision.mixed_precision in ("bf16", "fp16") else 4)
    traffic = grad_bytes * 2 * (world - 1) / world
    if not registry.of(cfg).holds_whole_model(cfg):  # ZeRO-3, FSDP: parameters gathered for use
        traffic += 2 * grad_bytes * (world - 1) / world
    return traffic


def checkpoint_bytes(params: int) -> int:
    """fp32 weights plus Adam's two fp32 moments: what a checkpoint holds, at least."""
    return params * 12


def config_values(cfg: RunConfig) -> dict[str, str]:
    """{dotted key: its value as JSON}, secrets masked: what every machine must agree on."""
    from overdrive.config.keys import flatten
    from overdrive.config.redact import redact

    return {k: json.dumps(v, sort_keys=True) for k, v in flatten(redact(cfg.model_dump(mode="json"))).items()}


def join_process_group(cfg: RunConfig) -> tuple[int, int, Any]:
    """(rank, world, the device the collectives are measured on). On CUDA each local rank takes
    its own GPU before NCCL starts (without it every rank uses cuda:0 and NCCL stops at the first
    collective: "Duplicate GPU detected"); a mixed backend (`cuda:nccl,cpu:gloo`, FSDP's offload)
    is measured on the GPU, where NCCL carries the training's collectives."""
    import torch
    import torch.distributed as dist

    from overdrive.strategies.cpu import process_group_backend

    backend = process_group_backend(cfg) or ("nccl" if torch.cuda.is_available() else "gloo")
    on_cuda = "nccl" in backend and torch.cuda.is_available()
    from overdrive.config.env_report import local_rank

    device = torch.device("cuda", local_rank()) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def run_checks(cfg: RunConfig) -> dict[str, Any]:
    """In a worker (or the lone process): every check; rank 0 judges; every rank gets the verdict."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    grouped = dist.is_available() and cfg.launch.num_processes > 1
    rank, world, device = join_process_group(cfg) if grouped else (0, 1, torch.device("cpu"))
    rendezvous_s = time.perf_counter() - started
    params = model_params(cfg)
    out = Path(cfg.output_dir).expanduser()
    token_path = directory(out) / "preflight.token"
    token = uuid.uuid4().hex
    if rank == 0:
        token_path.parent.mkdir(parents=True, exist_ok=True)
        token_path.write_text(token)
    if grouped:
        box = [token]
        dist.broadcast_object_list(box, src=0)
        token = box[0]
        dist.barrier()
    try:
        sees = token_path.read_text() == token
    except OSError:
        sees = False
    free = shutil.disk_usage(out if out.exists() else out.parent).free
    mine = {"rank": rank, "host": socket.gethostname(), "machine": cfg.launch.machine_rank, "versions": versions(),
            "config": {k: v for k, v in config_values(cfg).items() if k not in PER_MACHINE_KEYS},
            "sees_output_dir": sees, "free_bytes": free}
    comm = measure_collectives(world, min(BUCKET_BYTES, params * 4), device) if grouped else None
    everyone = [None] * world
    if grouped:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    verdict: list[Any] = [None]
    if rank == 0:
        from overdrive.observe.preflight_report import judge

        verdict[0] = judge(cfg, everyone, comm, rendezvous_s, params, step_traffic_bytes(cfg, params, world),
                           checkpoint_bytes(params))
    if grouped:
        dist.broadcast_object_list(verdict, src=0)
        dist.barrier()
    local_main = (dist.get_rank() % max(world // max(cfg.launch.num_machines, 1), 1) == 0) if grouped else True
    if local_main:
        path = result_path(out, cfg.launch.machine_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict[0], indent=1))
    if rank == 0 and token_path.exists():
        token_path.unlink()
    if grouped:
        dist.destroy_process_group()
    return verdict[0]
