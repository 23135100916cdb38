"""The GPU paths, checked on a CPU-only machine by what is handed to the libraries or written
for the cluster: the process-group backend and timeout, the FP8 recipe objects, the sbatch
script, the optimizer's parameter groups, the probe's memory terms.

A GPU machine is described explicitly (`gpus=8`, `Hardware(gpus=...)`) rather than faked;
the few tests that need a real device are marked `gpu` and skipped here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from conftest import cfg_of
import torch

from overdrive.resolving import resolve
from overdrive.errors import UserError
from overdrive.strategies import accelerator_kwargs, cpu

def init_handler(kwargs):
    from accelerate.utils import InitProcessGroupKwargs

    found = [h for h in kwargs["kwargs_handlers"] if isinstance(h, InitProcessGroupKwargs)]
    assert len(found) == 1
    return found[0]


# ------------------------------------------------------------------ 1. FSDP offload: cuda:nccl,cpu:gloo


@pytest.mark.parametrize("key", ["parallel.fsdp.offload_params=true", "parallel.fsdp.state_dict_type=full_state_dict"])
def test_fsdp_offload_on_gpus_gets_the_mixed_backend_accelerate_would_pick(key, monkeypatch):
    cfg = cfg_of("parallel.strategy=fsdp", key)
    handler = init_handler(accelerator_kwargs(cfg, 2, gpus=8))
    # What Accelerate passes to init_process_group (to_kwargs drops values equal to its defaults).
    assert handler.to_kwargs()["backend"] == "cuda:nccl,cpu:gloo"
    # Accelerate keeps a named backend on CUDA (state.py, _prepare_backend): no "not available" error.
    from accelerate.state import PartialState

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # read only: "this is a GPU machine"
    backend, _ = PartialState._prepare_backend(object.__new__(PartialState), False, False, handler.backend)
    assert backend == "cuda:nccl,cpu:gloo"
    # Without offload: nccl, picked by Accelerate; on CPU processes: gloo alone.
    assert init_handler(accelerator_kwargs(cfg_of("parallel.strategy=fsdp"), 2, gpus=8)).backend is None
    assert init_handler(accelerator_kwargs(cfg, 2, gpus=0)).backend == "gloo"


# ------------------------------------------------------------------ 2. scripts for a cluster


def _script(*cli: str) -> str:
    from overdrive.launch.lines import sbatch_script

    return sbatch_script(resolve([], cli=list(cli), env={}))


GPU_JOB = ("parallel.strategy=deepspeed", "precision.mixed_precision=bf16", "launch.num_processes=16",
           "launch.num_machines=2", "launch.main_process_ip=node0")


def test_a_slurm_script_for_2x8_gpus_forces_nothing_onto_the_cpu(tmp_path):
    script = _script(*GPU_JOB, f"output_dir={tmp_path / 'run'}")
    body = script.split("OVERDRIVE_RESOLVED")[0] + script.split("OVERDRIVE_RESOLVED")[-1]  # not the config itself
    assert "#SBATCH --gpus-per-node=8" in body
    for forcing in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS=1\n", "--cpu", "gloo"):
        assert forcing not in body, forcing
    # The thread count is worked out on the node, not on the machine writing the script.
    assert "OMP_NUM_THREADS=$(( $(nproc) / 8" in body
    # Slurm opens --output before the script runs: it must not point into the output_dir it creates.
    output = next(line for line in body.splitlines() if line.startswith("#SBATCH --output="))
    assert str(tmp_path) not in output


def test_cpu_only_refusals_do_not_block_scripts_for_a_gpu_cluster(tmp_path, capsys):
    from overdrive.cli import main

    out = tmp_path / "job.sh"
    code = main(["slurm", *GPU_JOB, "precision.mixed_precision=fp16", "launch.backend=nccl",
                 f"output_dir={tmp_path / 'run'}", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    # A CPU cluster is said in the config, and then the script is for CPUs, refusals included.
    code = main(["slurm", *GPU_JOB, "launch.gpus_per_machine=0", "precision.mixed_precision=fp16",
                 f"output_dir={tmp_path / 'run'}"])
    assert code == 2 and "precision.mixed_precision" in capsys.readouterr().err
    script = _script(*GPU_JOB, "launch.use_cpu=true", f"output_dir={tmp_path / 'run'}")
    assert "export DS_ACCELERATOR=cpu" in script and "--gpus-per-node" not in script


def test_print_launch_lines_follow_the_config_not_this_machine(tmp_path, capsys):
    from overdrive.cli import main

    assert main(["train", *GPU_JOB, f"output_dir={tmp_path}", "--print-launch"]) == 0
    printed = capsys.readouterr().out
    assert "DS_ACCELERATOR" not in printed and "OMP_NUM_THREADS=1 " not in printed


# ------------------------------------------------------------------ 3. use_cpu on a GPU machine


def test_use_cpu_hides_the_gpus_from_every_worker_and_names_gloo():
    from overdrive.launch.process import process_env

    cfg = cfg_of("launch.use_cpu=true", "parallel.strategy=deepspeed", "launch.num_processes=2")
    env = process_env(cfg)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    kwargs = accelerator_kwargs(cfg, 2, gpus=8)  # even on a machine with 8 GPUs
    assert init_handler(kwargs).backend == "gloo" and kwargs["cpu"] is False
    fsdp = cfg_of("launch.use_cpu=true", "parallel.strategy=fsdp", "launch.num_processes=2")
    assert accelerator_kwargs(fsdp, 2, gpus=8)["cpu"] is True  # FSDP's mesh then follows the CPU device
    assert "CUDA_VISIBLE_DEVICES" not in process_env(cfg_of("launch.num_processes=2"))


@pytest.mark.slow
def test_a_lone_use_cpu_process_hides_the_gpus_before_cuda_starts():
    code = ("import os, sys; from overdrive.resolving import load_config; "
            "from overdrive.launch.process import prepare_this_process; "
            "prepare_this_process(load_config(cli=sys.argv[1:], env={})); "
            "print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-c", code, "launch.use_cpu=true"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "''"


# ------------------------------------------------------------------ 4. the collectives' timeout


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed", "fsdp"])
@pytest.mark.parametrize("gpus", [0, 8])
def test_every_strategy_hands_accelerate_the_configured_timeout(strategy, gpus):
    default = init_handler(accelerator_kwargs(cfg_of(f"parallel.strategy={strategy}"), 2, gpus=gpus))
    assert default.to_kwargs()["timeout"] == timedelta(minutes=60)  # not torch's 10 minutes on nccl
    longer = cfg_of(f"parallel.strategy={strategy}", "launch.timeout_minutes=240")
    assert init_handler(accelerator_kwargs(longer, 2, gpus=gpus)).to_kwargs()["timeout"] == timedelta(hours=4)


# ------------------------------------------------------------------ 5. fp8 recipes


def test_fp8_settings_reach_the_recipe_accelerate_is_given(monkeypatch):
    from accelerate.utils import TERecipeKwargs
    import accelerate.utils.dataclasses as accelerate_dataclasses

    from overdrive.strategies.library_features import msamp_supported

    # Transformer Engine is not installed here; its recipe only checks that it is.
    monkeypatch.setattr(accelerate_dataclasses, "is_transformer_engine_available", lambda: True)
    cfg = cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=TE", "precision.fp8.fp8_format=E4M3",
                 "precision.fp8.amax_history_len=16", "precision.fp8.amax_compute_algo=max", "precision.fp8.margin=2")
    recipes = [h for h in accelerator_kwargs(cfg, 1, gpus=1)["kwargs_handlers"] if isinstance(h, TERecipeKwargs)]
    assert len(recipes) == 1
    r = recipes[0]
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == ("E4M3", 16, "max", 2)
    if not msamp_supported():  # Accelerate 1.16 and later: refused by key (tests/test_tested_versions.py)
        return
    from accelerate.utils import MSAMPRecipeKwargs

    msamp = cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=MSAMP", "precision.fp8.opt_level=O1")
    handlers = accelerator_kwargs(msamp, 1, gpus=1)["kwargs_handlers"]
    assert [h.opt_level for h in handlers if isinstance(h, MSAMPRecipeKwargs)] == ["O1"]


def test_an_fp8_engine_that_is_not_installed_is_named_not_swapped():
    with pytest.raises(UserError, match="precision.fp8.backend"):
        accelerator_kwargs(cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=TE"), 1, gpus=1)


# ------------------------------------------------------------------ 6. DeepSpeed fp16 overflows


def test_deepspeed_fp16_overflows_are_the_loss_scalers_not_bad_steps():
    from overdrive.strategies import loss_scaler_owns_overflows
    from overdrive.training.guards import nonfinite

    cfg = cfg_of("parallel.strategy=deepspeed", "precision.mixed_precision=fp16")
    assert loss_scaler_owns_overflows(cfg)
    assert not loss_scaler_owns_overflows(cfg_of("parallel.strategy=deepspeed", "precision.mixed_precision=fp16",
                                                      "parallel.deepspeed.loss_scale=1024"))
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    guard = nonfinite.NonfiniteGuard("stop", optimizer, torch.device("cpu"), deepspeed=True,
                                     dynamic_loss_scale=loss_scaler_owns_overflows(cfg))
    for _ in range(6):  # DeepSpeed reports an overflowing step's gradient norm as inf
        guard.check(torch.tensor(float("inf")))
    counts = guard.read()
    assert counts.skipped == 0 and counts.verdict("stop", 5, 2.5, 6) == ""


# ------------------------------------------------------------------ 7. the auto micro-batch probe on a GPU


def test_the_gpu_probe_counts_what_forward_and_backward_do_not_allocate():
    from overdrive.training.build import autobatch

    cfg = cfg_of("training.micro_batch_size=auto", "training.global_batch_size=16",
                 "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=1", "launch.num_processes=2")
    device = 100 * 2**20  # the default model's states take ~12 MiB of it
    terms = dict(autobatch.probe_terms(cfg, 4, measured_bytes=80 * 2**20, device_bytes=device))
    assert terms["optimizer states (estimator)"] > 0 and terms["fp32 master weights (estimator)"] > 0
    assert terms["communication buffers (estimator)"] > 0
    assert terms["margin (10% of the device)"] == device // 10
    # 80% of the device for forward and backward fits on its own, not with the rest.
    assert sum(terms.values()) > 0
    assert sum(dict(autobatch.probe_terms(cfg, 4, 70 * 2**20, device)).values()) <= 0


def test_sharded_strategies_are_not_probed_with_a_whole_model(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from overdrive.training.build import autobatch

    def whole_model(*args, **kwargs):
        raise AssertionError("built the whole model on one device")

    monkeypatch.setattr(autobatch, "make_probe", whole_model)
    for sharded in (("parallel.strategy=fsdp",), ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3")):
        cfg = cfg_of("training.micro_batch_size=4", "training.global_batch_size=16", *sharded)
        AcceleratorState._reset_state(reset_partial_state=True)
        try:
            confirmed = autobatch.confirm(cfg, Accelerator(cpu=True))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
        assert confirmed.training.micro_batch_size == 4  # the prediction stands


def test_cublas_allocation_failures_are_out_of_memory():
    from overdrive.training.build import autobatch

    assert autobatch._is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not autobatch._is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_measures_on_a_real_gpu():
    from overdrive.training.build import autobatch

    cfg = cfg_of("training.micro_batch_size=auto", "training.global_batch_size=8")
    assert autobatch.make_probe(cfg, torch.device("cuda", 0))(1) is None
    # A device of one byte: the measured forward and backward alone do not fit.
    assert autobatch.make_probe(cfg, torch.device("cuda", 0), device_bytes=1)(1) is not None


# ------------------------------------------------------------------ 8. ZeRO-3 built under zero.Init

ZERO_INIT = """
import json, os, torch, deepspeed
from overdrive.training.build.optimization import param_groups
from overdrive.training.build.model import flop_params
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
with deepspeed.zero.Init(config_dict_or_path=config):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
groups = param_groups(model, 0.1)
print(json.dumps({"dims": [p.dim() for p in model.parameters()],
                  "decayed": [len(p.ds_shape) for p in groups[0]["params"]],
                  "flop_params": flop_params(model)}))
"""


@pytest.mark.slow
def test_zero3_placeholders_keep_weight_decay_and_flops(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    done = subprocess.run([sys.executable, "-c", ZERO_INIT], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # What DeepSpeed hands us: empty placeholders, whatever their real shape.
    assert set(result["dims"]) != {2, 1}
    # The two weight matrices are decayed; biases and the norm are not.
    assert result["decayed"] == [2, 2]
    assert result["flop_params"] == 16 * 32 + 32 + 2 * 32 + 32 * 4 + 4


def _free_port() -> int:
    from conftest import free_port

    return free_port()


# ------------------------------------------------------------------ 9. launch.gpu_ids


def test_gpu_ids_are_what_validation_counts():
    from overdrive.resolving.validate import hardware_problems
    from overdrive.system.hardware import Gpu, Hardware

    eight = Hardware(gpus=tuple(Gpu("NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0)) for _ in range(8)), cpu_cores=64)
    cfg = cfg_of("launch.num_processes=8", "launch.gpu_ids=0,1,2,3")
    found = hardware_problems(cfg, {}, eight)
    assert [p.key for p in found] == ["launch.num_processes"] and "Duplicate GPU" in found[0].message
    assert hardware_problems(cfg_of("launch.num_processes=4", "launch.gpu_ids=0,1,2,3"), {}, eight) == []
    missing = hardware_problems(cfg_of("launch.num_processes=2", "launch.gpu_ids=6,9"), {}, eight)
    assert [p.key for p in missing] == ["launch.gpu_ids"]


def test_one_process_on_chosen_gpus_is_started_with_them_visible():
    from overdrive.launch.process import needs_launcher, process_env

    cfg = cfg_of("launch.gpu_ids=2")
    assert needs_launcher(cfg) and process_env(cfg)["CUDA_VISIBLE_DEVICES"] == "2"
    assert not needs_launcher(cfg_of()) and not needs_launcher(cfg_of("launch.gpu_ids=2", "launch.use_cpu=true"))


# ------------------------------------------------------------------ lower severity


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 NVL", "bf16", 835e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 80GB HBM3", "no", 67e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", 312e12),  # no fp8 on Ampere: its 16-bit peak
    ("NVIDIA RTX A1000", "bf16", None),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12),
])
def test_mfu_peak_by_whole_gpu_name_and_precision(name, precision, peak):
    from overdrive.training.telemetry import gpu_peak_flops

    assert gpu_peak_flops(name, precision) == peak


def test_pinned_batches_are_copied_without_waiting():
    assert accelerator_kwargs(cfg_of("data.pin_memory=true"), 1)["dataloader_config"].non_blocking is True
    assert accelerator_kwargs(cfg_of(), 1)["dataloader_config"].non_blocking is False


def test_nvme_offload_path_is_checked(tmp_path):
    from overdrive.resolving.validate import hardware_problems
    from overdrive.system.hardware import Hardware

    items = ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "parallel.deepspeed.offload_param=nvme")
    missing = hardware_problems(cfg_of(*items, f"parallel.deepspeed.nvme_path={tmp_path / 'nope'}"), {}, Hardware())
    assert [p.key for p in missing] == ["parallel.deepspeed.nvme_path"] and "does not exist" in missing[0].message
    assert hardware_problems(cfg_of(*items, f"parallel.deepspeed.nvme_path={tmp_path}"), {}, Hardware()) == []


def test_nccl_on_cpu_is_refused_in_one_place():
    from overdrive.resolving.validate import hardware_problems
    from overdrive.system.hardware import Hardware

    cfg = cfg_of("launch.backend=nccl")
    # strategies/cpu.py's rule, asked before training on this machine and by the launcher alike
    assert [p.key for p in hardware_problems(cfg, {}, Hardware())] == ["launch.backend"]
    assert [p.key for p in cpu.problems(cfg, gpus=0)] == ["launch.backend"]
    assert cpu.problems(cfg, gpus=8) == []


def test_deepspeed_activation_checkpointing_says_it_does_nothing_for_transformers():
    from overdrive.resolving import resolve

    resolved = resolve([], cli=["parallel.strategy=deepspeed", "parallel.deepspeed.activation_checkpointing=true"], env={})
    assert any(w.key == "parallel.deepspeed.activation_checkpointing" for w in resolved.warnings)


def test_torchao_fp8_under_fsdp_names_the_loading_key_accelerate_would_refuse():
    cfg = cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=AO", "parallel.strategy=fsdp")
    with pytest.raises(UserError, match="parallel.fsdp.cpu_ram_efficient_loading"):
        accelerator_kwargs(cfg, 2, gpus=8)
