"""The strategy registry: one description per strategy, asked by the rest of overdrive."""

from __future__ import annotations

import pytest
from conftest import cfg_of

from overdrive.strategies import registry


@pytest.mark.parametrize("stage, shards", [
    (0, (False, False, False)), (1, (False, False, True)), (2, (False, True, True)), (3, (True, True, True))])
def test_zero_stage_decides_what_is_sharded(stage, shards):
    cfg = cfg_of("parallel.strategy=deepspeed", f"parallel.deepspeed.zero_stage={stage}")
    s = registry.of(cfg).sharding(cfg)
    assert (s.parameters, s.gradients, s.optimizer_state) == shards
    assert registry.of(cfg).checkpoint_per_rank(cfg) is (stage >= 1)


def test_fsdp_shards_parameters_only_when_resharding_after_forward():
    for reshard in (True, False):
        cfg = cfg_of("parallel.strategy=fsdp", f"parallel.fsdp.reshard_after_forward={str(reshard).lower()}")
        s = registry.of(cfg).sharding(cfg)
        assert s.parameters is reshard and s.gradients and s.optimizer_state


def test_ddp_shards_nothing_and_its_type_follows_the_launch():
    one = cfg_of()
    assert not registry.of(one).sharding(one).any and registry.of(one).distributed_type(one) == "NO"
    two_cpu = cfg_of("launch.num_processes=2", "launch.use_cpu=true")
    assert registry.of(two_cpu).distributed_type(two_cpu) == "MULTI_CPU"
    assert registry.of(cfg_of("parallel.strategy=fsdp")).distributed_type(cfg_of()) == "FSDP"


def test_questions_read_a_stored_config_read_back_as_a_run_config():
    from overdrive.config.stored import read_stored

    cfg = cfg_of("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "parallel.deepspeed.offload_param=cpu",
                 "parallel.deepspeed.offload_optimizer=cpu")
    dump = read_stored({"config": cfg.model_dump(mode="json")}, "resolved.json")
    strategy = registry.of(dump)
    assert strategy is registry.of(cfg) is registry.DEEPSPEED
    assert strategy.estimator_row(dump) == strategy.estimator_row(cfg) == "zero3_offload"
    assert strategy.label(dump) == "deepspeed ZeRO-3 (offload optimizer to cpu, params to cpu)"


def test_every_estimator_row_a_run_can_select_exists():
    from overdrive.memory.formulas import STRATEGIES

    runs = [cfg_of(), cfg_of("parallel.strategy=fsdp"), cfg_of("parallel.strategy=fsdp", "parallel.fsdp.offload_params=true")]
    runs += [cfg_of("parallel.strategy=deepspeed", f"parallel.deepspeed.zero_stage={z}", f"parallel.deepspeed.offload_optimizer={o}")
             for z in (0, 1, 2, 3) for o in ("none", "cpu") if z or o == "none"]
    assert {registry.of(c).estimator_row(c) for c in runs} <= set(STRATEGIES)


def test_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="ddp, deepspeed, fsdp"):
        registry.named("megatron")
