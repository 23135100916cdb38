"""Mixture-of-experts models: the router's balance loss in the loss optimised (the model's own),
normalised so the split does not change it, logged apart with the load per expert; `model.moe.*`."""

from __future__ import annotations

import pytest
import torch

from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.training.objectives import moe
from overdrive.training.step import step_loss
from overdrive.training.metrics import read
from tests.conftest import free_port, run_cli

ARCH = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
TINY = [*(f"model.architecture.{k}={v}" for k, v in ARCH.items()), "model.moe.aux_loss_coef=0.1",
        "tokenizer.vocab_size=512", "data.max_length=32", "data.max_bytes=60000", "training.max_steps=6",
        "training.log_every_steps=1", "checkpoint.enabled=false", "checkpoint.save_final_model=false",
        "precision.mixed_precision=no"]


class _OneProcess:
    device = torch.device("cpu")
    num_processes = 1


def _tiny_qwen3_moe(coef: float = 0.5):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    arch = {k: v for k, v in ARCH.items() if k != "model_type"}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, router_aux_loss_coef=coef, **arch))


def _batch(rows: int = 3, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (rows, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, 6:] = 0  # a padded row: its padding is no token of the router's statistic
    labels = ids.masked_fill(mask == 0, step_loss.IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _optimised(model, balance, batch) -> torch.Tensor:
    """The loss the loop optimises on one micro-batch that is the whole global batch: the token
    objective with the balance term beside it, normalised by step_loss.py."""
    from overdrive.training.objectives.objective import TokenObjective

    objective = moe.BalancedObjective(TokenObjective("causal-lm"), balance, _OneProcess(), sharing=1)
    totals = step_loss.global_counts(_OneProcess(), [batch], 1, objective.counts)
    return step_loss.share(objective.sums(model, batch), totals)


def _tiny_mixtral(coef: float = 0.5):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64,
                                            router_aux_loss_coef=coef))


@pytest.mark.parametrize("build", [_tiny_qwen3_moe, _tiny_mixtral], ids=["qwen3_moe", "mixtral"])
def test_the_loss_optimised_is_the_models_own_with_its_router_loss(build):
    model = build()
    batch = _batch()
    own = model(**batch, output_router_logits=True)
    plain = model(**batch).loss  # the cross entropy alone
    balance = moe.attach(RunConfig(model={"moe": {"aux_loss_scope": "micro_batch"}}), model, _OneProcess())
    assert balance is not None and balance.coef == 0.5 and len(balance.routers) == 2
    loss = _optimised(model, balance, batch)
    assert torch.allclose(loss, own.loss, rtol=1e-6, atol=0) and loss.item() > plain.item() + 0.5  # the aux term is in
    record = balance.read(_OneProcess(), 1)
    assert record["aux_loss"] == pytest.approx(own.aux_loss.item(), rel=1e-6)
    # 3 rows x 10 positions, 4 padded, each token to 2 experts, in each of the 2 layers
    assert sum(record["expert_tokens"]) == 26 * 2 * 2 and record["expert_imbalance"] >= 1.0
    # The gradient is the model's own too.
    router = balance.routers[0].weight
    grad = torch.autograd.grad(loss, router)[0]
    own_grad = torch.autograd.grad(model(**batch, output_router_logits=True).loss, router)[0]
    assert torch.allclose(grad, own_grad, rtol=1e-5, atol=1e-8)


def test_the_sequence_scope_is_the_mean_of_each_rows_own_statistic():
    model = _tiny_qwen3_moe()
    batch = _batch()
    balance = moe.attach(RunConfig(), model, _OneProcess())  # the default scope: sequence
    loss = _optimised(model, balance, batch)
    rows = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(3)]
    each = [model(**row, output_router_logits=True).aux_loss for row in rows]
    plain = model(**batch).loss
    assert torch.allclose(loss, plain + 0.5 * torch.stack(each).mean(), rtol=1e-6)
    # A micro-batch of one row is exactly the model's own loss.
    alone = _tiny_qwen3_moe()
    one_row = _optimised(alone, moe.attach(RunConfig(), alone, _OneProcess()), rows[0])
    assert torch.allclose(one_row, alone(**rows[0], output_router_logits=True).loss, rtol=1e-6)


def test_model_moe_keys_override_the_config_and_are_refused_on_a_dense_model():
    from overdrive.hf.model_config import model_config

    cfg = RunConfig(model={"architecture": ARCH, "moe": {"top_k": 3, "aux_loss_coef": 0.05}})
    config = model_config(cfg, 64)
    assert (config.num_experts_per_tok, config.router_aux_loss_coef) == (3, 0.05)
    with pytest.raises(UserError) as error:
        model_config(RunConfig(model={"architecture": ARCH, "moe": {"top_k": 5}}), 64)
    assert "model.moe.top_k" in error.value.render() and "4 experts" in error.value.render()
    with pytest.raises(UserError) as error:
        model_config(RunConfig(model={"moe": {"top_k": 2}}), 512)  # the default GPT-2 has no experts
    assert "model.moe.top_k" in error.value.render() and "no routed experts" in error.value.render()


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read(out / "metrics.jsonl").records if "loss" in r}


@pytest.mark.slow
def test_any_split_ddp_expert_parallel_and_ep_x_fsdp2_give_the_one_process_losses_and_resume_at_ep_1(tmp_path):
    """4x1 = 2x2 on one process = 2 processes x 2 (DDP) = the same with the experts split over them
    (EP 2, all-to-all over gloo) = EP 2 x FSDP2 on 4 processes, 6 steps, with the balance term in
    the loss; the EP x FSDP2 run's step-3 checkpoint continues at ep_size 1 (FSDP2, 2 processes) on
    the same losses; the saved models are whole, in Transformers' names."""
    import shutil

    common = [*TINY, f"data.cache_dir={tmp_path / 'cache'}", "training.global_batch_size=4"]
    two = ["training.micro_batch_size=2", "launch.num_processes=2"]
    saved = ["checkpoint.save_final_model=true"]
    runs = {"4x1": ["training.micro_batch_size=4", *saved], "2x2": ["training.micro_batch_size=2"],
            "ddp": [*two, f"launch.main_process_port={free_port()}"],
            "ep2": [*two, "parallel.ep_size=2", *saved, f"launch.main_process_port={free_port()}"],
            "ep2xfsdp2": ["training.micro_batch_size=1", "launch.num_processes=4", "parallel.strategy=fsdp",
                          "parallel.ep_size=2", "checkpoint.enabled=true", "checkpoint.every_steps=3", *saved,
                          f"launch.main_process_port={free_port()}"]}
    got = {}
    for name, items in runs.items():
        done = run_cli("train", *common, *items, f"output_dir={tmp_path / name}", timeout=600)
        assert done.returncode == 0, name + done.stdout[-2000:] + done.stderr[-3000:]
        got[name] = _losses(tmp_path / name)
        records = [r for r in read(tmp_path / name / "metrics.jsonl").records if "loss" in r]
        assert all(r["aux_loss"] > 0.5 and len(r["expert_tokens"]) == 4 for r in records)

    # Stopped after step 3 (its later checkpoint and model gone), continued without expert parallel.
    resumed = tmp_path / "resumed-at-ep1"
    shutil.copytree(tmp_path / "ep2xfsdp2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000006")
    shutil.rmtree(resumed / "model")
    done = run_cli("train", *common, "training.micro_batch_size=1", "launch.num_processes=2", "parallel.strategy=fsdp",
                   "checkpoint.enabled=true", "checkpoint.every_steps=3", f"launch.main_process_port={free_port()}",
                   f"output_dir={resumed}", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout and "step-00000003" in done.stdout
    got["resumed at ep 1"] = _losses(resumed)

    assert sorted(got["4x1"]) == list(range(1, 7))
    for name in ("2x2", "ddp", "ep2", "ep2xfsdp2", "resumed at ep 1"):
        for step, loss in got["4x1"].items():
            assert abs(got[name][step] - loss) <= 1e-4 * abs(loss), (name, step, got[name][step], loss)
    from safetensors.torch import load_file

    one = load_file(tmp_path / "4x1" / "model" / "model.safetensors")
    for name in ("ep2", "ep2xfsdp2"):
        split = load_file(tmp_path / name / "model" / "model.safetensors")
        assert set(one) == set(split) and any(".experts.3." in key for key in split)  # every expert, Transformers' names
        assert all(torch.allclose(one[key], split[key], atol=1e-5) for key in one), name


# Qwen3-30B-A3B as published (its config.json's sizes): 48 layers, 128 experts of width 768, 8 per token.
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001}


def test_the_estimate_of_qwen3_30b_a3b_counts_3_3b_active_parameters_and_experts_per_ep_rank(tmp_path):
    import json

    from overdrive.memory import estimate
    from overdrive.memory.model_shape import model_shape, resolve_source
    from overdrive.memory.report import to_json
    from overdrive.memory.shape import Setup

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    shape = model_shape(resolve_source(str(tmp_path / "config.json")))
    assert 30.4e9 < shape.params < 30.6e9 and 3.3e9 < shape.active_params < 3.4e9  # "30B-A3B": 30.5B, 3.3B active
    assert (shape.experts, shape.top_k) == (128, 8) and shape.intermediate == 8 * 768
    whole = estimate(shape, Setup(devices=8), ("ddp", "fsdp2"))
    split = estimate(shape, Setup(devices=8, ep=8), ("ddp", "fsdp2"))
    data = json.loads(to_json(split))
    assert data["active_parameters"] == shape.active_params
    assert data["moe"]["expert_parameters_per_ep_rank"] * 8 == shape.expert_params == 128 * 48 * 3 * 2048 * 768
    # 2048 tokens x 8 experts x 2048 wide x 2 bytes, 7 in 8 pairs off-rank, there and back in both passes, 48 layers
    assert data["moe"]["all_to_all_bytes_per_micro_batch"] == 4 * 2048 * 8 * 2048 * 2 * 48 * 7 // 8
    # DDP keeps the parameters whole: expert parallel leaves 16 of the 128 experts on each rank.
    kept = shape.params - shape.expert_params * 7 // 8
    assert split.row("ddp").params_bytes == pytest.approx(whole.row("ddp").params_bytes * kept / shape.params, rel=1e-6)
    # EP x FSDP2: FSDP2 shards the dense weights over the 8 ranks and each rank holds its experts
    # whole: at ep 8 that is the eighth FSDP2 alone holds, at ep 2 a half of the experts.
    dense = shape.params - shape.expert_params
    assert split.row("fsdp2").params_bytes == pytest.approx(whole.row("fsdp2").params_bytes, rel=1e-3)
    pairs = estimate(shape, Setup(devices=8, ep=2), ("fsdp2",)).row("fsdp2")
    assert pairs.params_bytes == pytest.approx(4 * (dense / 8 + shape.expert_params / 2), rel=1e-3)
    assert any("routed experts, 1/2 of them held whole" in what for _, what, _ in pairs.terms)


def test_flops_per_token_count_the_experts_a_token_is_routed_to():
    model = _tiny_qwen3_moe()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * 4 * 3 * 32 * 16
    assert moe.idle_params(model) == (experts // 2, 0)  # 2 of 4 experts idle for each token; nothing frozen
    for p in model.parameters():
        p.requires_grad_(False)
    assert moe.idle_params(model) == (experts // 2, experts // 2)


def _resolve(tmp_path, *items, files=()):
    from overdrive.resolving import resolve

    base = [item for item in TINY if not item.startswith("model.moe.")]  # a file's model.moe.* is not overridden
    return resolve(files=list(files), cli=[*base, f"output_dir={tmp_path / 'run'}", *items], env={},
                   accelerate_default=False)


@pytest.mark.parametrize("items, key, text", [
    (["parallel.ep_size=2", "launch.num_processes=3", "checkpoint.enabled=false"], "parallel.ep_size",
     "does not divide the data-parallel degree 3"),
    (["parallel.ep_size=2", "launch.num_processes=2", "parallel.strategy=deepspeed", "checkpoint.enabled=false"],
     "parallel.ep_size", "composed with ddp and fsdp here, not with deepspeed"),
    (["parallel.ep_size=2", "launch.num_processes=4", "parallel.strategy=fsdp", "parallel.dp_replicate_size=2",
      "checkpoint.enabled=false"], "parallel.ep_size", "not with HSDP"),
    (["parallel.ep_size=2", "launch.num_processes=2", "peft.method=lora", "checkpoint.enabled=false"],
     "parallel.ep_size", "adapter"),
])
def test_each_expert_parallel_rule_names_its_key(tmp_path, items, key, text):
    with pytest.raises(UserError) as error:
        _resolve(tmp_path, *items)
    assert f"{key}: " in error.value.render() and text in error.value.render()


def test_the_model_must_have_experts_that_divide_by_ep_size():
    from overdrive.hf.model_config import model_config
    from overdrive.strategies import layout

    def problems(arch, ep):
        cfg = RunConfig(model={"architecture": arch}, parallel={"ep_size": ep}, launch={"num_processes": 4})
        return [str(p.key) + ": " + p.message for p in layout.model_problems(cfg, model_config(cfg, 64))]

    assert problems(ARCH, 2) == [] and problems(ARCH, 4) == []
    assert problems({**ARCH, "num_experts": 6}, 4) == ["parallel.ep_size: the model's 6 experts do not divide by 4"]
    assert "no routed experts" in problems({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}, 2)[0]


def test_a_balance_term_under_pipeline_stages_is_refused_by_key_and_none_is_hooked_there():
    from overdrive.hf.model_config import model_config
    from overdrive.resolving.validate_model import shape_rules

    def keys(*moe):
        cfg = RunConfig.model_validate({"model": {"architecture": {**ARCH, "router_aux_loss_coef": 0.01}, "moe": dict(moe)},
                                        "data": {"max_length": 32},
                                        "parallel": {"pp_size": 2}, "launch": {"num_processes": 2}})
        return [p.key for p in shape_rules(cfg, model_config(cfg, 64))]

    assert keys() == ["parallel.pp_size"]  # each stage holds some of the routers: the term would be dropped
    assert keys(("aux_loss_coef", 0.0)) == []  # trained without it: nothing to drop


def test_megatrons_expert_parallel_and_moe_arguments_are_read_onto_their_keys(tmp_path):
    path = tmp_path / "megatron.yaml"
    path.write_text("distributed_type: MEGATRON_LM\nnum_processes: 2\nmegatron_lm_config:\n"
                    "  megatron_lm_expert_model_parallel_size: 2\n  other_megatron_args:\n    moe_router_topk: 1\n"
                    "    moe_aux_loss_coeff: 0.02\n    moe_router_load_balancing_type: aux_loss\n")
    cfg = _resolve(tmp_path, "checkpoint.enabled=false", files=[path]).config
    assert (cfg.parallel.ep_size, cfg.model.moe.top_k, cfg.model.moe.aux_loss_coef) == (2, 1, 0.02)
    assert cfg.model.moe.aux_loss_scope == "micro_batch"  # Megatron's aux_loss is per micro-batch
    path.write_text(path.read_text() + "    num_moe_experts: 8\n    moe_grouped_gemm: true\n")
    with pytest.raises(UserError) as error:
        _resolve(tmp_path, "checkpoint.enabled=false", files=[path])
    text = error.value.render()
    assert "other_megatron_args.num_moe_experts" in text and "the model's own config" in text
    assert "other_megatron_args.moe_grouped_gemm" in text


@pytest.mark.parametrize("targets, parts", [
    ("all-linear", {"attention", "experts", "router"}),
    (["q_proj", "k_proj", "v_proj", "o_proj"], {"attention"}),
    (["gate_proj", "up_proj", "down_proj"], {"experts"}),
    (["gate"], {"router"}),
])
def test_lora_on_experts_says_which_parts_it_adapts_and_the_estimator_counts_the_same(targets, parts):
    from overdrive.config.experts import adapter_group
    from overdrive.config.schema_peft import PeftConfig
    from overdrive.memory.adapter import adapter_shape
    from overdrive.memory.model_shape import build_meta_model
    from overdrive.training.build import adapter

    cfg = RunConfig(model={"architecture": ARCH}, peft={"method": "lora", "r": 4, "target_modules": targets})
    model = adapter.apply(cfg, _tiny_qwen3_moe())
    trained = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert {adapter_group(name) for name in trained} == parts
    said = moe.adapter_note(model)[0].split("by part: ")[1].split(". ")[0]  # "attention 512, router 128"
    assert {entry.split(" ")[0] for entry in said.split(", ")} == parts
    counted = adapter_shape(build_meta_model(_tiny_qwen3_moe().config), PeftConfig(method="lora", r=4, target_modules=targets))
    assert counted.trainable == sum(trained.values())


def test_qlora_of_a_mixture_of_experts_is_refused_by_key(tmp_path):
    from overdrive.launch.job_checks import layout_problems

    _tiny_qwen3_moe().save_pretrained(tmp_path / "moe")
    pretrained = f"model.name_or_path={tmp_path / 'moe'}"
    found = layout_problems(_resolve(tmp_path, pretrained, "peft.method=qlora").config)
    assert [p.key for p in found] == ["peft.method"] and "stacked tensors bitsandbytes cannot quantize" in found[0].message
    assert layout_problems(_resolve(tmp_path, pretrained, "peft.method=lora").config) == []


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_on_one_process_with_the_same_next_steps(tmp_path):
    """EP 2 saves at step 3 (experts and their Adam moments gathered whole); killed after it, resumed at
    ep_size 1 on one process at the same global batch, steps 4-6 are EP 2's own."""
    import shutil

    out = tmp_path / "run"
    common = [*TINY, f"data.cache_dir={tmp_path / 'cache'}", "training.global_batch_size=4", "training.micro_batch_size=2",
              "checkpoint.enabled=true", "checkpoint.every_steps=3", f"output_dir={out}"]
    done = run_cli("train", *common, "parallel.ep_size=2", "launch.num_processes=2",
                   f"launch.main_process_port={free_port()}", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    whole = _losses(out)
    shutil.rmtree(out / "checkpoints" / "step-00000006")  # as if killed after step 3's checkpoint
    done = run_cli("train", *common, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    resumed = {r["step"]: (r["loss"], r["num_processes"]) for r in read(out / "metrics.jsonl").records if "loss" in r}
    assert [resumed[s][1] for s in (3, 4, 5, 6)] == [2, 1, 1, 1]
    for step in (4, 5, 6):
        assert abs(resumed[step][0] - whole[step]) <= 1e-4 * whole[step], (step, resumed[step], whole[step])


def test_deepspeeds_autoep_is_refused_by_its_key_and_off_asks_for_nothing(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                                "expert_parallel": {"enabled": True, "autoep_size": 2, "top_k": 2}}))
    with pytest.raises(UserError) as error:
        _resolve(tmp_path, files=[path])
    text = error.value.render()
    assert "expert_parallel.enabled" in text and "parallel.strategy=ddp parallel.ep_size=2" in text
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": False}}))
    assert _resolve(tmp_path, files=[path]).config.parallel.strategy == "deepspeed"


@pytest.mark.slow
def test_lora_on_a_pretrained_mixture_of_experts_trains_with_the_balance_term(tmp_path):
    from tests.hf_fixtures import make_text_data, make_tiny_qwen3_moe

    base = make_tiny_qwen3_moe(tmp_path / "base")
    done = run_cli("train", f"model.name_or_path={base}", "peft.method=lora", "peft.r=4",
                   f"data.source={make_text_data(tmp_path / 'text.jsonl')}", "data.max_length=32",
                   "training.max_steps=3", "training.log_every_steps=1", "training.micro_batch_size=2",
                   "checkpoint.enabled=false", f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "trainable parameters by part: attention 1,792, experts 5,632, router 288" in done.stdout + done.stderr
    records = [r for r in read(tmp_path / "run" / "metrics.jsonl").records if "loss" in r]
    assert len(records) == 3 and all(r["aux_loss"] > 0.5 and r["aux_loss_coef"] == 0.001 for r in records)
    assert (tmp_path / "run" / "model" / "adapter_model.safetensors").is_file()


def test_a_users_script_is_not_launched_with_an_expert_parallel_degree(tmp_path):
    from overdrive.launch.user_script import launch_script

    run = _resolve(tmp_path, "parallel.ep_size=2", "launch.num_processes=2")
    with pytest.raises(UserError) as error:
        launch_script(run, str(tmp_path / "train.py"), [])
    assert "parallel.ep_size: " in error.value.render() and "overdrive train" in error.value.render()


def test_model_moe_keys_on_a_dense_model_are_refused_before_anything_launches(tmp_path):
    from overdrive.training.build.preconditions import check_model_layout

    cfg = _resolve(tmp_path, "model.architecture.model_type=gpt2", "model.architecture.n_layer=1",
                   "model.architecture.n_embd=32", "model.architecture.n_head=2", "model.architecture.n_positions=64",
                   "model.moe.top_k=2").config
    with pytest.raises(UserError, match="model.moe.top_k: the model \\(gpt2\\) has no routed experts"):
        check_model_layout(cfg)
