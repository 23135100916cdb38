"""`training.loss_kernel`: the chunked and fused token losses give the model's own summed loss and
gradients without the logits; what does not compose is refused by key; `auto` keeps `full` on CPU."""

from __future__ import annotations

import pytest
import torch

from overdrive.training.step import step_loss

VOCAB = 3000


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=512, tie_word_embeddings=False, use_cache=False,
                                        **extra))


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 200), generator=g)
    labels = ids.clone()
    labels[0, :37] = -100  # a prompt left out of the loss
    labels[1, 150:] = -100
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch, kernel):
    model.zero_grad(set_to_none=True)
    loss = step_loss.summed_loss(model, batch, kernel)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (loss, grads), (loss_ref, grads_ref) = got, want
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads_ref.items():
        assert (grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-12, name


def test_full_is_the_models_own_summed_loss():
    model, batch = _llama(), _batch()
    own = model(**batch, num_items_in_batch=1).loss
    assert torch.equal(step_loss.summed_loss(model, batch), own)
    assert torch.equal(step_loss.summed_loss(model, batch, "full"), own)


@pytest.mark.parametrize("kernel", ["chunked", "fused"])
def test_kernel_gives_the_full_loss_and_gradients(kernel, monkeypatch):
    from overdrive.config import loss_kernel

    monkeypatch.setattr(loss_kernel, "CHUNK_LOGITS_BYTES", 4 * VOCAB * 64)  # 64-token slices: several per row
    model, batch = _llama(), _batch()
    _assert_same(_loss_and_grads(model, batch, kernel), _loss_and_grads(model, batch, "full"))


def test_chunked_gives_grpos_per_token_log_probs_entropies_and_gradients(monkeypatch):
    """GRPO under chunked: each completion token's log-prob (at a temperature) and entropy, and the
    gradients of a loss of them, as from the completions' logits, several slices per row."""
    from overdrive.config import loss_kernel
    from overdrive.training.objectives import grpo, grpo_loss

    monkeypatch.setattr(loss_kernel, "CHUNK_LOGITS_BYTES", 4 * VOCAB * 5)  # 5-token slices
    model = _llama()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 4, 9)]
    completions = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 3, 8)]
    batch = grpo.completion_batch(prompts, completions, torch.tensor([1.0, -0.5, -0.5]), 0, torch.device("cpu"))

    def scored(kernel):
        model.zero_grad(set_to_none=True)
        logps, entropy = grpo.completion_logps(model, batch, 0.7, kernel)
        token = grpo_loss.per_token_loss(logps, None, None, batch["advantages"], 0.0, 0.2, 0.28)
        grpo_loss.reduce(token.loss, batch["completion_mask"], "dapo", 12).backward()
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (logps, entropy, grads), (logps_ref, entropy_ref, grads_ref) = scored("chunked"), scored("full")
    assert torch.allclose(logps, logps_ref, atol=1e-5) and torch.allclose(entropy, entropy_ref, atol=1e-5)
    for name, grad in grads_ref.items():
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-12, name


@pytest.mark.parametrize("kernel", ["chunked", "fused"])
def test_kernel_under_lora_and_gradient_checkpointing(kernel):
    from peft import LoraConfig, get_peft_model

    model = _llama()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = _batch()
    got, want = _loss_and_grads(model, batch, kernel), _loss_and_grads(model, batch, "full")
    assert all("lora" in name for name in want[1])
    _assert_same(got, want)


def test_a_head_with_an_adapter_is_refused_by_key():
    from peft import LoraConfig, get_peft_model

    from overdrive.errors import UserError

    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(UserError) as caught:
        step_loss.summed_loss(model, _batch(), "chunked")
    assert caught.value.problems[0].key == "training.loss_kernel"


def test_the_head_is_left_as_it_was_and_logits_made_without_calling_it_are_refused():
    import types

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from overdrive.errors import UserError

    model, batch = _llama(), _batch()
    step_loss.summed_loss(model, batch, "chunked")
    assert "forward" not in vars(model.lm_head)  # nn.Linear's own forward again

    def bypass(self, input_ids=None, logits_to_keep=0, **kwargs):  # the head's weight used, its call not
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=torch.nn.functional.linear(hidden, self.lm_head.weight))

    model.forward = types.MethodType(bypass, model)
    with pytest.raises(UserError) as caught:
        step_loss.summed_loss(model, batch, "chunked")
    assert caught.value.problems[0].key == "training.loss_kernel"


@pytest.mark.parametrize("items, key", [
    (["parallel.tp_size=2", "launch.num_processes=2"], "parallel.tp_size"),
    (["parallel.pp_size=2", "launch.num_processes=2"], "parallel.pp_size"),
])
def test_what_does_not_compose_is_refused_by_key(items, key):
    from overdrive.resolving import validate_loss

    for kernel in ("chunked", "fused"):
        cfg = _config([f"training.loss_kernel={kernel}", *items])
        problems = validate_loss.loss_rules(cfg, lambda key: "")
        assert [p.key for p in problems] == ["training.loss_kernel"] and key in problems[0].message
    auto = _config(items)
    assert validate_loss.loss_rules(auto, lambda key: "") == [] and validate_loss.kernel_runs(auto, "cuda") == "full"


OBJECTIVES = {  # every objective whose loss is not a causal LM's token cross entropy
    "classification": ["model.task=sequence-classification"],
    "dpo": ["data.format=preference", "preference.method=dpo"],
    "kto": ["data.format=preference", "preference.method=kto"],
    "orpo": ["data.format=preference", "preference.method=orpo"],
    "simpo": ["data.format=preference", "preference.method=simpo"],
    "reward": ["data.format=preference", "preference.method=reward", "model.task=sequence-classification"],
}
GRPO = ["data.format=prompts", "rl.method=grpo"]


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_an_objective_the_kernels_do_not_compute_refuses_them_by_their_own_key(objective, tmp_path):
    """The table of what composes refuses chunked and fused by training.loss_kernel (not by model.task),
    with auto settling on full; plan and estimate (kernel_runs, run_estimate) count no saving for them."""
    from overdrive.memory.model_shape import model_shape, resolve_source, run_estimate
    from overdrive.resolving import composition, validate_loss

    shape = model_shape(resolve_source(_llama_128k(tmp_path), []))
    for kernel in ("chunked", "fused"):
        cfg = _config([f"training.loss_kernel={kernel}", *OBJECTIVES[objective]])
        refused = composition.problems(cfg)
        assert [p.key for p in refused] == ["training.loss_kernel"], refused
        assert objective in refused[0].message and "loss_kernel=full" in refused[0].fix
        assert validate_loss.loss_rules(cfg, lambda key: "") == []  # said once, by the table
        assert validate_loss.kernel_runs(cfg, "cuda") == validate_loss.kernel_runs(cfg, "cpu") == "full"
        row = run_estimate(cfg, "cpu", shape).rows[0]
        assert not any(f"{kernel} loss" in what for _, what, _ in row.terms)
    auto = _config(OBJECTIVES[objective])
    assert composition.problems(auto) == [] and validate_loss.kernel_runs(auto, "cuda") == "full"
    from overdrive.commands.estimate import _loss_kernel  # estimate's and plan's --loss-kernel on this run
    from overdrive.errors import UserError

    with pytest.raises(UserError) as caught:
        _loss_kernel("chunked", auto, "cuda")
    assert caught.value.problems[0].key == "training.loss_kernel" and objective in caught.value.problems[0].message
    assert _loss_kernel("auto", auto, "cuda") == "full"


def test_grpo_takes_chunked_and_refuses_fused_by_its_own_key():
    """chunked computes GRPO's per-token log-probs (counted as such by plan and estimate); fused's
    kernels return a summed cross entropy only, so it is refused by training.loss_kernel, and
    auto settles on full for GRPO wherever it would pick fused."""
    from overdrive.commands.estimate import _loss_kernel
    from overdrive.errors import UserError
    from overdrive.resolving import composition, validate_loss

    chunked = _config(["training.loss_kernel=chunked", *GRPO])
    assert composition.problems(chunked) == [] and validate_loss.loss_rules(chunked, lambda key: "") == []
    assert validate_loss.kernel_runs(chunked, "cuda") == "chunked" == _loss_kernel("chunked", chunked, "cpu")
    fused = _config(["training.loss_kernel=fused", *GRPO])
    refused = composition.problems(fused)
    assert [p.key for p in refused] == ["training.loss_kernel"] and "chunked" in refused[0].fix
    assert validate_loss.kernel_runs(fused, "cuda") == "full"
    with pytest.raises(UserError):
        _loss_kernel("fused", chunked, "cuda")
    auto = _config(GRPO)
    assert validate_loss.kernel_runs(auto, "cuda") == validate_loss.kernel_runs(auto, "cpu") == "full"


SHARDED = [["parallel.strategy=fsdp", "launch.num_processes=2"],
           ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "launch.num_processes=2"]]


@pytest.mark.parametrize("items", SHARDED, ids=["fsdp2", "zero3"])
def test_a_head_sharded_at_rest_takes_the_kernel_and_its_estimate_counts_it(items, tmp_path):
    """FSDP2 and ZeRO-3 gather the head inside its own call, where the kernels run: not refused,
    and plan / estimate (run_estimate, as plan asks) count the kernel's loss for the run's strategy."""
    from overdrive.config import loss_kernel
    from overdrive.memory.model_shape import model_shape, resolve_source, run_estimate
    from overdrive.resolving import validate_loss

    shape = model_shape(resolve_source(_llama_128k(tmp_path), []))
    rows = {}
    for kernel in ("full", "chunked", "fused"):
        cfg = _config([f"training.loss_kernel={kernel}", "data.max_length=2048", "precision.mixed_precision=no",
                       *items])
        assert validate_loss.loss_rules(cfg, lambda key: "") == []
        assert validate_loss.kernel_runs(cfg, "cpu") == kernel
        rows[kernel] = run_estimate(cfg, "cpu", shape).rows[0]
    assert rows["full"].strategy in ("fsdp2", "zero3")
    for kernel in ("chunked", "fused"):
        assert any(f"{kernel} loss" in what for _, what, _ in rows[kernel].terms)
        assert rows[kernel].activations_bytes < 0.15 * rows["full"].activations_bytes
    auto = _config(items)
    assert validate_loss.kernel_runs(auto, "cuda") == loss_kernel.chosen("auto", "cuda")


def _llama_128k(directory) -> str:
    """The bench's small Llama at Llama 3's vocabulary, as a config file (no weights)."""
    import json

    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 256,
        "intermediate_size": 688, "max_position_embeddings": 2048, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 128_256}))
    return str(directory / "config.json")


def _config(items: list[str]):
    from overdrive.config.keys import coerce, set_dotted
    from overdrive.config.schema import RunConfig

    values: dict = {}
    for item in items:
        key, value = item.split("=", 1)
        set_dotted(values, key, coerce(key, value))
    return RunConfig.model_validate(values)


def test_auto_keeps_the_models_own_loss_on_cpu():
    from overdrive.config import loss_kernel

    assert loss_kernel.chosen("auto", "cpu") == "full"
    assert loss_kernel.chosen("auto", "cuda") == ("fused" if loss_kernel.liger_installed() else "full")
    assert loss_kernel.chosen("chunked", "cpu") == "chunked"


def test_estimate_counts_each_kernels_loss(tmp_path):
    """At a 128k vocabulary the loss dominates `full`'s activations; `chunked` and `fused` count a
    slice and the head's weight gradient (bench/bench_loss_kernel.py measures them within 10%)."""
    from dataclasses import replace

    from overdrive.memory import estimate_row
    from overdrive.memory.model_shape import model_shape, resolve_source
    from overdrive.memory.shape import Setup

    shape = model_shape(resolve_source(_llama_128k(tmp_path), []))
    setup = Setup(precision="no", micro_batch=1, seq_len=2048, target="cpu")
    rows = {k: estimate_row("ddp", shape, replace(setup, loss_kernel=k)) for k in ("full", "chunked", "fused")}
    full = rows["full"].activations_bytes
    assert full > 2047 * 128_256 * 12  # log-softmax, its gradient, the logits' gradient: fp32 each
    for kernel in ("chunked", "fused"):
        assert rows[kernel].activations_bytes < 0.15 * full
        assert any(kernel in what for _, what, _ in rows[kernel].terms)
    held = estimate_row("ddp", shape, replace(setup, logits_held=True)).activations_bytes
    assert held - full == 2048 * 128_256 * 4  # a caller that holds the logits (preference methods)
    # Offloading moves saved layers to the host on CUDA; on a CPU they are there already.
    gpu = replace(setup, target="cuda", loss_kernel="chunked")
    offloaded = estimate_row("ddp", shape, replace(gpu, activation_offloading=True))
    assert offloaded.activations_bytes < estimate_row("ddp", shape, gpu).activations_bytes and offloaded.host_bytes > 0
    assert estimate_row("ddp", shape, replace(setup, activation_offloading=True)).total_bytes == rows["full"].total_bytes


def test_evaluation_without_gradients_gives_the_same_sum():
    model, batch = _llama().eval(), _batch()
    with torch.no_grad():
        full = step_loss.summed_loss(model, batch)
        chunked = step_loss.summed_loss(model, batch, "chunked")
    assert abs(chunked - full) <= 1e-5 * abs(full)
