"""Predicted activation memory against what the forward pass really keeps, on CPU.

Measured = unique storages of the tensors autograd saves for backward (saved_tensors_hooks)
plus tensors created in the forward pass that are still alive after it (the logits the
caller holds, the layer inputs non-reentrant checkpointing keeps), minus parameters and
anything that existed before the forward pass. The model is the schema's default
(`model.architecture`, vocabulary `tokenizer.vocab_size`), built by overdrive.training.build.model as the
trainer builds it, in training mode (dropout on).
"""

from __future__ import annotations

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

from overdrive.config.schema import RunConfig  # noqa: E402
from overdrive.memory import estimate_row  # noqa: E402
from overdrive.memory.model_shape import Source, hf_config_for_run, model_shape  # noqa: E402
from overdrive.memory.shape import setup_for_run  # noqa: E402


def _storage(t):
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (st.data_ptr(), st.nbytes()) if st.nbytes() else None


def _alive() -> set:
    keys = set()
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    keys.add(_storage(obj))
            except ReferenceError:
                continue
    return keys - {None}


def forward_saved(model, inputs: dict):
    """(bytes the forward keeps for backward or leaves alive, the model's output)."""
    gc.collect()
    before = _alive() | {_storage(p) for p in model.parameters()}
    saved = set()

    def pack(t):
        saved.add(_storage(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    gc.collect()
    held = (saved | _alive()) - before - {None}
    return sum(n for _, n in held), out


def measure_activations(model, batch: int, seq_len: int, vocab: int) -> int:
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    nbytes, out = forward_saved(model, {"input_ids": ids, "labels": ids})
    out.loss.backward()  # the graph really was usable
    return nbytes


def _config(checkpointing: bool, seq_len: int) -> RunConfig:
    return RunConfig.model_validate({"model": {"gradient_checkpointing": checkpointing},
                                     "data": {"max_length": seq_len}, "launch": {"use_cpu": True}})


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("seq_len", [128, 512])
def test_activation_estimate_matches_measurement(checkpointing, seq_len):
    from overdrive.training.build.model import build_model

    cfg = _config(checkpointing, seq_len)
    batch, vocab = 4, cfg.tokenizer.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg, vocab)
    model.train()
    measured = measure_activations(model, batch, seq_len, vocab)

    shape = model_shape(Source(hf_config_for_run(cfg), "default", run=cfg, attn_implementation=model.config._attn_implementation))
    setup = setup_for_run(cfg, "cpu", micro_batch=batch, seq_len=seq_len, precision="no")
    predicted = estimate_row("ddp", shape, setup).activations_saved_bytes
    error = predicted / measured - 1
    print(f"seq {seq_len} ckpt {checkpointing}: predicted {predicted:,} measured {measured:,} error {error:+.2%}")
    assert abs(error) < 0.25
    # The estimate is built term by term from what autograd keeps: it should be far closer.
    assert abs(error) < 0.02


def test_head_is_counted():
    """At an 8k vocabulary the logits and the fp32 log-softmax dwarf a layer at short lengths."""
    cfg = _config(False, 128)
    shape = model_shape(Source(hf_config_for_run(cfg), "default", run=cfg))
    from overdrive.memory.activations import estimate_activations

    act = estimate_activations(shape, setup_for_run(cfg, "cpu", micro_batch=4, precision="no"), autocast=False)
    assert act.logits == 4 * 128 * shape.vocab * 4
    assert act.head > act.logits  # log-softmax output (fp32) + final norm + LM-head input + labels
    assert act.head + act.logits > act.layer


@pytest.mark.slow
@pytest.mark.parametrize("family,kv_heads,checkpointing,attn", [
    ("llama", 2, False, "sdpa"), ("llama", 4, False, "eager"), ("llama", 2, True, "sdpa"), ("qwen3", 2, False, "sdpa")],
    ids=["gqa-sdpa", "mha-eager", "gqa-checkpointed", "qwen3-qk-norm-head-dim"])
def test_llama_class_activations(family, kv_heads, checkpointing, attn):
    """RMSNorm in Python, SwiGLU, rotary embeddings, grouped K/V heads, eager's causal mask; Qwen3's RMSNorm of
    each head of Q and K and a head_dim that is not hidden / heads (64 x 4 heads beside a hidden size of 128)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from overdrive.memory import Setup
    from overdrive.memory.model_shape import shape_of_model

    config = AutoConfig.for_model(family, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=kv_heads, intermediate_size=344, vocab_size=1000,
                                  max_position_embeddings=512, use_cache=False,
                                  **({"head_dim": 64} if family == "qwen3" else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    measured = measure_activations(model, 2, 256, 1000)
    setup = Setup(devices=1, precision="no", micro_batch=2, seq_len=256, checkpointing=checkpointing, target="cpu")
    predicted = estimate_row("ddp", shape_of_model(model, family), setup).activations_saved_bytes
    assert abs(predicted / measured - 1) < 0.02
