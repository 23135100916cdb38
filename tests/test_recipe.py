"""Optimizers, schedules and data mixtures: built, checked at load and described, without processes.

The multi-process checks (each optimizer at 1 and 2 processes, a mixture killed and resumed)
are in tests/test_recipe_runs.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import refusal

from overdrive import cli
from overdrive.resolving import resolve
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.memory.model_shape import Source, model_shape
from overdrive.memory.shape import setup_for_run
from overdrive.training.build import optimization, optimizers

ARCH = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 128}


def tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**{k: v for k, v in ARCH.items() if k != "model_type"}))


def config(**sections) -> RunConfig:
    return RunConfig.model_validate({"model": {"architecture": ARCH}, **sections})


def messages_of(*items: str) -> dict[str, str]:
    return {p.key: p.message for p in refusal(*items).problems}


def held_state_bytes(optimizer) -> int:
    parts = getattr(optimizer, "parts", [optimizer])
    return sum(t.numel() * t.element_size() for part in parts for state in part.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


@pytest.mark.parametrize("name, optim", [
    ("adamw", {}), ("sgd", {}), ("sgd", {"momentum": 0.0}), ("adafactor", {}), ("lion", {}), ("muon", {}),
    ("schedule_free_adamw", {}),
])
def test_the_state_an_optimizer_holds_is_what_the_estimator_counts(name, optim):
    """One step of the real optimizer on a tiny GPT-2: the bytes in its state equal the
    estimator's bytes per parameter x parameters (within the step counters and scalars)."""
    cfg = config(optim={"name": name, **optim}, scheduler={"name": "constant"})
    model = tiny_model()
    optimizer = optimizers.build_optimizer(model, cfg, "cpu")
    optimizers.set_mode(optimizer, "train")
    ids = torch.randint(0, ARCH["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    from transformers import AutoConfig

    shape = model_shape(Source(AutoConfig.for_model("gpt2", **{k: v for k, v in ARCH.items() if k != "model_type"}),
                               "tiny"))
    expected = setup_for_run(cfg, "cpu").optimizer_state_bytes(shape) * shape.params
    assert held_state_bytes(optimizer) == pytest.approx(expected, rel=0.01, abs=64), name


def test_a_checkpoint_from_another_optimizer_kernel_loads_with_this_runs_kernel():
    """Saved by a for-loop optimizer (expert parallel x FSDP2), loaded by a fused one: the moments
    and the step come back, the kernel stays this run's (else its step takes the other's path)."""
    model = tiny_model()
    saving = optimizers.build_optimizer(model, config(optim={"name": "adamw", "implementation": "for-loop"}), "cpu")
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    saving.step()
    loading = optimizers.build_optimizer(model, config(optim={"name": "adamw", "implementation": "fused"}), "cpu")
    kernel = {k: loading.param_groups[0].get(k) for k in optimizers.KERNEL_OPTIONS}
    loading.load_state_dict(saving.state_dict())
    assert {k: loading.param_groups[0].get(k) for k in optimizers.KERNEL_OPTIONS} == kernel and kernel["fused"]
    assert saving.param_groups[0]["fused"] is False  # the saving optimizer's own groups untouched
    moments = [loading.state[p]["exp_avg"] for p in model.parameters() if p in loading.state]
    assert moments and all(torch.equal(m, saving.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    loading.step()  # its own (fused) path


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = tiny_model()
    opt = optimizers.build_optimizer(model, config(optim={"name": "muon", "muon_lr": 0.05}), "cpu")
    muon, adamw = opt.parts
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    assert id(model.transformer.wte.weight) not in muon_params  # embeddings (and the tied head): AdamW
    assert id(model.transformer.wpe.weight) not in muon_params
    assert id(model.transformer.h[0].attn.c_attn.weight) in muon_params
    assert muon.param_groups[0]["lr"] == 0.05 and adamw.param_groups[0]["lr"] == 2e-3
    # The weight-decay rule holds on the AdamW side too: vectors never decay.
    assert all(g["weight_decay"] == 0.0 for g in adamw.param_groups if any(p.dim() < 2 for p in g["params"]))
    # One schedule scales both parts.
    schedule = optimizers.build_schedule(opt, config(optim={"name": "muon", "muon_lr": 0.05},
                                                     scheduler={"name": "linear", "warmup_steps": 0},
                                                     training={"max_steps": 10}))
    schedule.step()
    assert muon.param_groups[0]["lr"] == pytest.approx(0.05 * 0.9) and adamw.param_groups[0]["lr"] == pytest.approx(2e-3 * 0.9)
    opt.load_state_dict(opt.state_dict())  # both parts' states, round trip


def test_weight_decay_groups_for_every_named_optimizer():
    for name in ("adamw", "adam", "sgd", "adafactor", "lion", "schedule_free_adamw", "adamw_8bit"):
        opt = optimizers.build_optimizer(tiny_model(), config(optim={"name": name, "weight_decay": 0.1},
                                                              scheduler={"name": "constant"}), "cpu")
        for group in opt.param_groups:
            dims = {p.dim() for p in group["params"]}
            assert group["weight_decay"] == (0.1 if dims == {2} else 0.0), name


def test_a_class_path_is_built_with_its_kwargs():
    cfg = config(optim={"class_path": "torch.optim.RAdam", "kwargs": {"decoupled_weight_decay": True}})
    opt = optimizers.build_optimizer(tiny_model(), cfg, "cpu")
    assert type(opt).__name__ == "RAdam" and opt.defaults["decoupled_weight_decay"] is True


def test_bad_optimizer_input_is_refused_by_key():
    assert "optim.name" in messages_of("optim.name=sophia")
    found = messages_of("optim.name=sgd", "optim.kwargs.dampning=0.1")
    assert "did you mean `dampening`" in found["optim.kwargs.dampning"]
    assert "optim.kwargs.lr" in messages_of("optim.kwargs.lr=0.1")  # overdrive's own key
    assert "optim.class_path" in messages_of("optim.class_path=torch.optim.Nope")
    # It replaces the schedule: a schedule the user chose is refused (the default one follows, test_first_hour.py).
    assert "scheduler.name" in messages_of("optim.name=schedule_free_adamw", "scheduler.name=cosine")


@pytest.mark.parametrize("items, key", [
    (["optim.name=muon", "parallel.strategy=fsdp"], "optim.name"),
    (["optim.name=adafactor", "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"], "optim.name"),
    (["optim.name=adamw_8bit", "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"], "optim.name"),
    (["optim.name=schedule_free_adamw", "scheduler.name=constant", "parallel.strategy=deepspeed",
      "parallel.deepspeed.zero_stage=2"], "optim.name"),
])
def test_optimizers_that_need_whole_matrices_are_refused_where_they_get_pieces(items, key):
    assert key in messages_of(*items)


@pytest.mark.parametrize("items", [
    ["optim.name=sgd", "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"],
    ["optim.name=lion", "parallel.strategy=fsdp"],
    ["optim.name=schedule_free_adamw", "scheduler.name=constant", "parallel.strategy=fsdp"],
])
def test_elementwise_optimizers_are_accepted_with_sharding(items):
    assert resolve(cli=items, accelerate_default=False).config.optim.name


def test_offload_keeps_deepspeed_cpu_adam_for_adam_only():
    from overdrive.strategies.deepspeed import forces_ds_cpu_optimizer

    def cfg(name):
        return config(optim={"name": name}, parallel={"strategy": "deepspeed", "deepspeed": {
            "zero_stage": 2, "offload_optimizer": "cpu"}})

    # Accelerate would otherwise replace any torch optimizer (SGD, Lion) by DeepSpeedCPUAdam.
    assert not forces_ds_cpu_optimizer(cfg("sgd")) and not forces_ds_cpu_optimizer(cfg("lion"))


@pytest.mark.parametrize("name, extra", [
    ("wsd", {"decay_fraction": 0.25}), ("polynomial", {"power": 2.0}), ("inverse_sqrt", {}),
    ("cosine_with_restarts", {"num_cycles": 2}),
])
def test_transformers_schedules_with_a_floor(name, extra):
    from transformers import optimization as hf

    cfg = config(scheduler={"name": name, "warmup_steps": 10, "min_lr_ratio": 0.1, **extra},
                 training={"max_steps": 100}, optim={"lr": 1.0})
    curve = dict(optimization.lr_curve(cfg, points=100))
    assert curve[9] == pytest.approx(1.0, abs=0.11)  # the end of warm-up reaches the peak
    assert min(lr for step, lr in curve.items() if step >= 10) >= 0.1 - 1e-9  # the floor, after warm-up
    if name == "wsd":  # Transformers' own function, unchanged: stable, then a cosine over the last 25%
        reference = hf.get_wsd_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 10, 22,
                                        num_training_steps=100, min_lr_ratio=0.1)
        assert all(curve[s] == pytest.approx(reference.lr_lambdas[0](s)) for s in curve)
        assert curve[70] == 1.0 and curve[99] == pytest.approx(0.1, abs=0.01)
    if name == "polynomial":
        assert curve[99] == pytest.approx(0.1, abs=0.02)


def test_plan_lists_the_lr_curve_key_points():
    cfg = config(scheduler={"name": "wsd", "warmup_steps": 10, "decay_fraction": 0.2}, training={"max_steps": 110})
    steps = [step for step, _ in optimization.lr_curve(cfg)]
    assert {0, 9, 10, 89, 90, 109} <= set(steps)


# --------------------------------------------------------------------------- mixtures


def test_a_mixture_keeps_its_weights_and_is_a_function_of_the_seed():
    from overdrive.data.mixing import Mixture

    parts = [list(range(1000)), list(range(10_000, 10_400))]
    mix = Mixture(parts, ["a", "b"], [0.7, 0.3], seed=42)
    for n in (100, 1600, 50_000):
        assert abs(mix.drawn(n)["a"] / n - 0.7) < 2 / n + 1e-3
    again = Mixture(parts, ["a", "b"], [0.7, 0.3], seed=42)
    assert [mix[k] for k in range(2000)] == [again[k] for k in range(2000)]
    other = Mixture(parts, ["a", "b"], [0.7, 0.3], seed=7)
    assert [mix[k] for k in range(200)] != [other[k] for k in range(200)]
    # Every sample of a source once before any twice; the second pass is a new order.
    first_pass = [x for x in (mix[k] for k in range(1600)) if x < 10_000][:1000]
    assert sorted(first_pass) == parts[0]
    assert mix.positions(1600)["b"]["epoch"] == 1  # 30% of 1600 > 400 samples of b


def test_a_stopping_mixture_ends_before_a_source_repeats():
    from overdrive.data.mixing import Mixture

    mix = Mixture([list(range(1000)), list(range(400))], ["a", "b"], [0.7, 0.3], seed=1, when_exhausted="stop")
    counts = mix.drawn(len(mix))
    assert counts["b"] <= 400 and mix.drawn(len(mix) + 1)["b"] == 401


def test_a_source_entry_inherits_data_keys_it_does_not_set(tmp_path):
    from overdrive.data.mixing import source_configs

    cfg = config(data={"text_column": "body", "sources": [
        {"name": "a", "source": "a.jsonl", "weight": 2}, {"name": "b", "source": "b.csv", "text_column": "text"}]})
    a, b = source_configs(cfg)
    assert (a.cfg.data.source, a.cfg.data.text_column, a.weight) == ("a.jsonl", "body", 2.0)
    assert (b.cfg.data.source, b.cfg.data.text_column, b.weight) == ("b.csv", "text", 1.0)
    assert a.cfg.data.sources == [] and b.key == "data.sources.1"


def test_bad_mixtures_are_refused_by_key():
    assert "data.sources.0.weight" in messages_of('data.sources=[{"name": "a", "source": "x", "weight": -1}]')
    assert "data.sources" in messages_of('data.sources=[{"name": "a", "source": "x", "weight": 0}, '
                                         '{"name": "b", "source": "y", "weight": 0}]')
    assert "data.sources.1.name" in messages_of('data.sources=[{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]')


def test_bad_input_exits_2_naming_the_key(capsys):
    for items, key in ((["optim.name=sophia"], "optim.name"), (["optim.kwargs.dampning=0.1", "optim.name=sgd"],
                                                                "optim.kwargs.dampning"),
                       (['data.sources=[{"name": "a", "source": "x", "weight": -1}]'], "data.sources.0.weight")):
        assert cli.main(["explain", *items]) == 2
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err


# --------------------------------------------------------------------------- DeepSpeed JSON


def test_a_deepspeed_lamb_block_is_read_with_its_lines_and_refused_on_cpu(tmp_path):
    path = tmp_path / "lamb.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}}}, indent=2))
    with pytest.raises(UserError) as refused:  # a config that says it trains on CPU: refused by explain too
        resolve([path], cli=["launch.use_cpu=true"], accelerate_default=False)
    assert "parallel.deepspeed.extra.optimizer.type" in refused.value.render()
    assert "lamb.json:7" in refused.value.render()
    resolved = resolve([path], accelerate_default=False)
    cfg = resolved.config
    assert cfg.optim.name == "deepspeed" and cfg.optim.lr == 1e-3
    origin = resolved.origins["optim.name"]
    assert origin.source.endswith("lamb.json") and origin.line == 7  # the "type" line
    from overdrive.strategies.deepspeed_config import ds_config

    block = ds_config(cfg, 1, find_hidden_size=False)["optimizer"]
    assert block["type"] == "Lamb" and block["params"]["lr"] == 1e-3 and block["params"]["max_coeff"] == 0.3
    from overdrive.resolving import hardware_warnings

    found = {p.key: p for p in hardware_warnings(resolved)}
    assert "parallel.deepspeed.extra.optimizer.type" in found
    assert "lamb.json:7" in found["parallel.deepspeed.extra.optimizer.type"].where


def test_the_tuner_keeps_the_optimizer_and_skips_strategies_it_cannot_run_under():
    from overdrive.tune.space import Facts, build_space

    facts = Facts(cpu_cores=2, gpu=False, supports_bf16=True, compiler="")
    muon = build_space(config(optim={"name": "muon"}, launch={"num_processes": 2}), facts)
    assert [o.label for o in muon.dimensions["strategy"]] == ["ddp"]
    lion = build_space(config(optim={"name": "lion"}, launch={"num_processes": 2}), facts)
    assert len(lion.dimensions["strategy"]) > 1
    for space in (muon, lion):
        assert not any(key.startswith("optim.") for options in space.dimensions.values() for o in options
                       for key, _ in o.values)
