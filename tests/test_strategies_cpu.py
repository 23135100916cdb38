"""The CPU workarounds of strategies/cpu.py, fact by fact.

The multi-process facts (DDP is MULTI_CPU, DeepSpeed counts both gloo ranks, FSDP2 shards
over gloo) are exercised by tests/test_strategies_multiprocess.py; here: the decisions
themselves, and a lone process (no launcher) running DeepSpeed and FSDP2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import cfg_of as shared_cfg_of

from overdrive.strategies import accelerator_kwargs, cpu


def cfg_of(*cli: str):
    return shared_cfg_of(*["launch.use_cpu=true", *cli])


def test_ddp_and_fsdp_are_built_with_cpu_true_deepspeed_is_not():
    assert accelerator_kwargs(cfg_of("parallel.strategy=ddp"), 2)["cpu"] is True
    assert accelerator_kwargs(cfg_of("parallel.strategy=fsdp"), 2)["cpu"] is True
    # cpu=True would make Accelerate ignore the DeepSpeed plugin.
    assert accelerator_kwargs(cfg_of("parallel.strategy=deepspeed"), 2)["cpu"] is False


def test_deepspeed_gets_gloo_named_and_ds_accelerator_in_the_worker_env():
    from accelerate.utils import InitProcessGroupKwargs

    cfg = cfg_of("parallel.strategy=deepspeed")
    handlers = accelerator_kwargs(cfg, 2)["kwargs_handlers"]
    assert [h.backend for h in handlers if isinstance(h, InitProcessGroupKwargs)] == ["gloo"]
    assert cpu.worker_env(cfg) == {"DS_ACCELERATOR": "cpu"}
    assert cpu.worker_env(cfg_of("parallel.strategy=ddp")) == {"DS_ACCELERATOR": "cpu"}  # Accelerate imports it too


def test_fsdp_on_cpu_is_promoted_after_construction():
    assert cpu.needs_fsdp_promotion(cfg_of("parallel.strategy=fsdp"))
    assert not cpu.needs_fsdp_promotion(cfg_of("parallel.strategy=ddp"))


def test_an_explicit_backend_wins():
    assert cpu.process_group_backend(cfg_of("launch.backend=mpi")) == "mpi"


LONE_PROCESS = """
import json, sys, torch
from overdrive.resolving import load_config
from overdrive import build_accelerator
from overdrive.strategies import shard_fraction
cfg = load_config(cli=sys.argv[1:], env={})
acc = build_accelerator(cfg)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=2)
model, opt, loader = acc.prepare(model, opt, loader)
for x in loader:
    acc.backward(model(x).pow(2).mean()); opt.step(); opt.zero_grad()
print(json.dumps({"type": str(acc.distributed_type).split(".")[-1], "n": acc.num_processes,
                  "fraction": shard_fraction(model)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy, expected", [
    (["parallel.strategy=fsdp"], "FSDP"),
    (["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "training.micro_batch_size=2",
      "parallel.deepspeed.reduce_bucket_size=64", "parallel.deepspeed.stage3_prefetch_bucket_size=64",
      "parallel.deepspeed.stage3_param_persistence_threshold=8"], "DEEPSPEED"),
])
def test_a_lone_process_runs_the_sharded_strategies(strategy, expected):
    """No launcher: launch.prepare_this_process gives it a one-member process group."""
    done = subprocess.run([sys.executable, "-c", LONE_PROCESS, "launch.use_cpu=true", *strategy],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"type": expected, "n": 1, "fraction": 1.0}


@pytest.mark.slow
def test_accelerates_own_switches_do_not_override_the_strategy():
    """ACCELERATE_USE_CPU=true in the shell would make Accelerate drop the DeepSpeed plugin
    (cpu=True); the config already read it (launch.use_cpu), so it must not act again."""
    import os

    code = ("from overdrive.resolving import load_config; from overdrive import build_accelerator; "
            "import sys; acc = build_accelerator(load_config(cli=sys.argv[1:])); "
            "print(str(acc.distributed_type).split('.')[-1])")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    done = subprocess.run([sys.executable, "-c", code, "parallel.strategy=deepspeed"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "DEEPSPEED"
