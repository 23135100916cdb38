"""The estimator's formulas, on hand-written shapes: no model, no process group."""

from __future__ import annotations

import pytest

from overdrive.config.schema import RunConfig
from overdrive.memory import STRATEGIES, Setup, estimate, estimate_row, zero_paper_bytes
from overdrive.memory.activations import (Dtypes, attention_kernel, estimate_activations, korthikanti_layer_bytes,
                                          layer_bytes_per_token)
from overdrive.memory.formulas import FIELDS
from overdrive.memory.report import Capacity, apply_verdict
from overdrive.memory.shape import ModelShape, fsdp2_shard_numel, setup_for_run, strategy_of_run, zero3_partition_numel

PSI = 7_000_000_000


def gpt(h=1024, a=16, layers=24, vocab=50257, f=None, **kw) -> ModelShape:
    """A GPT-style shape with parameter tensors laid out as in GPT-2 (Conv1D weights h x 3h ...)."""
    f = f or 4 * h
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, f), (f,), (f, h), (h,)]
    shapes = [(vocab, h), (1024, h)] + block * layers + [(h,), (h,)]
    params = sum(_n(s) for s in shapes)
    defaults = dict(name="gpt", model_type="gpt2", params=params, param_shapes=tuple(shapes), layers=layers,
                    hidden=h, heads=a, kv_heads=a, intermediate=f, vocab=vocab,
                    block_params=sum(_n(s) for s in block), root_params=vocab * h + 1024 * h + 2 * h,
                    largest_module_params=vocab * h, autocast_params=params - 1024 * h - 4 * h * layers - 2 * h)
    defaults.update(kw)
    return ModelShape(**defaults)


def _n(shape):
    out = 1
    for d in shape:
        out *= d
    return out


# ------------------------------------------------------------------ the ZeRO paper


@pytest.mark.parametrize("n", [1, 4, 64])
def test_paper_model_states(n):
    """(2 + 2 + K) * Psi, K = 12, divided as ZeRO-1/2/3 divide it (Rajbhandari et al. 2020, fig. 1)."""
    k = 12
    assert zero_paper_bytes(PSI, n, 0)["total"] == (2 + 2 + k) * PSI
    assert zero_paper_bytes(PSI, n, 1)["total"] == pytest.approx(2 * PSI + 2 * PSI + k * PSI / n)
    assert zero_paper_bytes(PSI, n, 2)["total"] == pytest.approx(2 * PSI + (2 + k) * PSI / n)
    assert zero_paper_bytes(PSI, n, 3)["total"] == pytest.approx((2 + 2 + k) * PSI / n)


def test_paper_figure_one_numbers():
    """The paper's own example: Psi = 7.5B, N = 64 -> 120, 31.4, 16.6, 1.9 GB."""
    psi = 7.5e9
    totals = [zero_paper_bytes(psi, 64, stage)["total"] / 1e9 for stage in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_deepspeed_rows_are_the_paper_split_plus_named_extras():
    s = gpt()
    n = 8
    setup = Setup(devices=n, precision="bf16", micro_batch=1, seq_len=1024)
    part = -(-s.params // (2 * n)) * 2  # flat groups padded to 2N elements
    z1, z2, z3 = (estimate_row(f"zero{k}", s, setup) for k in (1, 2, 3))
    for row in (z1, z2):
        assert row.params_bytes == pytest.approx(2 * s.params, rel=1e-6)
        assert row.master_weights_bytes + row.optimizer_bytes == pytest.approx(12 * part, rel=1e-6)
    assert z1.grads_bytes == pytest.approx(2 * s.params, rel=1e-6)  # whole until the boundary reduce
    assert z2.grads_bytes == pytest.approx((2 + 4) * part, rel=1e-6)  # + DeepSpeed's fp32 partition
    assert any("not in the paper" in what for _, what, _ in z2.terms)
    assert z3.params_bytes < 2 * s.params / n * 1.01 and z3.params_bytes > 2 * s.params / n
    assert z3.master_weights_bytes + z3.optimizer_bytes == pytest.approx(12 * s.params / n, rel=1e-3)


def test_fp32_means_no_half_copies():
    """precision 'no': params 4, grads 4, Adam 8; DDP has no master, DeepSpeed still clones one."""
    s = gpt()
    setup = Setup(devices=2, precision="no", micro_batch=1, seq_len=128)
    ddp = estimate_row("ddp", s, setup)
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes, ddp.master_weights_bytes) == (
        4 * s.params, 4 * s.params, 8 * s.params, 0)
    z2 = estimate_row("zero2", s, setup)
    assert z2.params_bytes == pytest.approx(4 * s.params, rel=1e-6)
    assert z2.master_weights_bytes == pytest.approx(4 * s.params / 2, rel=1e-6)


def test_mixed_precision_ddp_keeps_sixteen_bytes_and_autocast_copies():
    s = gpt()
    row = estimate_row("ddp", s, Setup(devices=4, precision="bf16"))
    assert row.params_bytes + row.grads_bytes + row.optimizer_bytes + row.master_weights_bytes == 16 * s.params
    assert row.buffers_bytes == 2 * s.autocast_params


def test_zero3_persistence_and_padding():
    s = gpt(h=64, a=2, layers=2, vocab=1000)
    setup = Setup(devices=3, precision="bf16")
    row = estimate_row("zero3", s, setup)
    part = sum(zero3_partition_numel(p, 3) for p in s.param_shapes)
    whole = sum(_n(p) for p in s.param_shapes if _n(p) <= 10 * 64)  # Accelerate's auto: 10 * hidden
    assert row.params_bytes == 2 * (part + whole)
    assert zero3_partition_numel((10,), 3) == 4
    assert fsdp2_shard_numel((10, 4), 3) == 16


def test_fsdp2_units():
    s = gpt()
    on = estimate_row("fsdp2", s, Setup(devices=8, precision="bf16", reshard_after_forward=True))
    off = estimate_row("fsdp2", s, Setup(devices=8, precision="bf16", reshard_after_forward=False))
    assert on.buffers_bytes == 2 * (s.root_params + 3 * s.block_params)
    assert off.buffers_bytes == 2 * (s.params + s.block_params)
    assert on.params_bytes + on.grads_bytes + on.optimizer_bytes == pytest.approx(16 * s.params / 8, rel=1e-3)


def test_offload_moves_states_to_host():
    s = gpt()
    setup = Setup(devices=4, precision="bf16")
    z3 = estimate_row("zero3", s, setup)
    off = estimate_row("zero3_offload", s, setup)
    assert off.optimizer_bytes == off.master_weights_bytes == 0
    assert off.host_bytes > z3.optimizer_bytes + z3.master_weights_bytes
    assert off.total_bytes < z3.total_bytes


def test_row_total_is_its_fields_and_terms_add_up():
    s = gpt()
    for row in estimate(s, Setup(devices=4, precision="bf16", micro_batch=2, seq_len=512)).rows:
        assert row.total_bytes == sum(getattr(row, f) for f in FIELDS)
        device_terms = sum(b for f, _, b in row.terms if f != "host")
        assert device_terms == row.total_bytes
        assert sum(b for f, _, b in row.terms if f == "host") == row.host_bytes
        d = row.to_dict()
        for key in ("strategy", "params_bytes", "grads_bytes", "optimizer_bytes", "master_weights_bytes",
                    "activations_bytes", "buffers_bytes", "total_bytes", "host_bytes", "fits"):
            assert key in d


# ------------------------------------------------------------------ activations


def test_korthikanti_reproduced_term_by_term():
    """16-bit, eager attention, 1-byte masks, fused GeLU: exactly s*b*h*(34 + 5*a*s/h) per layer,
    plus the LayerNorm statistics the paper leaves out (8 bytes per token per norm)."""
    s_, b, h, a = 2048, 1, 4096, 32
    shape = gpt(h=h, a=a, activation="gelu", attn_dropout=0.1, resid_dropout=0.1, attn_implementation="eager")
    setup = Setup(precision="bf16", micro_batch=b, seq_len=s_, target="cuda")
    per_token = layer_bytes_per_token(shape, setup, Dtypes.of(setup, autocast=False), "eager")
    assert per_token * s_ * b - 2 * 8 * s_ * b == korthikanti_layer_bytes(s_, b, h, a)


def test_flash_attention_drops_the_quadratic_term():
    shape = gpt(attn_dropout=0.1, resid_dropout=0.1)
    short, long = (Setup(precision="bf16", seq_len=n, target="cuda") for n in (1024, 8192))
    assert attention_kernel(shape, short) == "flash"
    d = Dtypes.of(short, autocast=False)
    # Linear in s: bytes per token do not grow with the sequence.
    assert layer_bytes_per_token(shape, short, d, "flash") == layer_bytes_per_token(shape, long, d, "flash")
    assert layer_bytes_per_token(shape, long, d, "eager") > 4 * layer_bytes_per_token(shape, long, d, "flash")
    # On CPU, SDPA with attention dropout is the math path (no fused kernel has dropout there).
    assert attention_kernel(shape, Setup(target="cpu")) == "math"
    assert attention_kernel(gpt(), Setup(target="cpu")) == "flash"


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    shape = gpt()
    setup = Setup(precision="bf16", micro_batch=4, seq_len=1024, checkpointing=True)
    row = estimate_row("zero2", shape, setup)
    act = estimate_activations(shape, setup, autocast=False)
    assert act.layer_input == 4 * 1024 * 2 * shape.hidden  # the paper's 2*s*b*h per layer
    assert row.activations_full_bytes - row.activations_checkpointed_bytes == (
        shape.layers * (act.layer - act.layer_input) - act.layer)
    assert row.activations_bytes == row.activations_checkpointed_bytes
    # fp32 residual stream under DDP's autocast: checkpointed inputs cost twice as much.
    assert estimate_row("ddp", shape, setup).activations_saved_bytes > row.activations_saved_bytes


# ------------------------------------------------------------------ run configs and verdicts


def test_setup_and_strategy_from_run_config():
    cfg = RunConfig.model_validate({
        "precision": {"mixed_precision": "bf16"}, "launch": {"num_processes": 4},
        "training": {"micro_batch_size": 8}, "data": {"max_length": 512},
        "parallel": {"strategy": "deepspeed", "deepspeed": {
            "zero_stage": 3, "offload_optimizer": "cpu", "reduce_bucket_size": 1000,
            "extra": {"data_types": {"grad_accum_dtype": "fp32"}}}},
    })
    setup = setup_for_run(cfg, "cuda", devices=8)
    assert (setup.devices, setup.precision, setup.micro_batch, setup.seq_len) == (8, "bf16", 8, 512)
    assert setup.reduce_bucket_size == 1000 and setup.prefetch_bucket_size is None and setup.grad_accum_fp32
    assert strategy_of_run(cfg) == "zero3_offload_optimizer"
    assert strategy_of_run(RunConfig()) == "ddp"
    assert strategy_of_run(RunConfig.model_validate({"parallel": {"strategy": "fsdp"}})) == "fsdp2"


def test_verdict_picks_the_cheapest_that_fits():
    s = gpt(h=4096, a=32, layers=32, vocab=32000)
    est = estimate(s, Setup(devices=8, precision="bf16", micro_batch=1, seq_len=2048))
    gib = 2**30
    best = apply_verdict(est, Capacity(80 * gib, 1024 * gib, "gpu", "test"))
    assert best is not None and best.fits
    first_fit = next(r for r in est.rows if r.fits)
    assert best is first_fit and est.rows.index(best) == STRATEGIES.index(best.strategy)
    assert not est.row("ddp").fits  # 16 bytes x 6.7B parameters is more than 80 GiB
    assert apply_verdict(est, Capacity(1 * gib, 1 * gib, "gpu", "tiny")) is None
