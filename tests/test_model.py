"""Models: Auto classes, inline architectures, local directories, FLOP counts."""

from __future__ import annotations

import pytest
import torch

from overdrive.training.build import model as model_mod
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError

TINY = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64}


def config(**model) -> RunConfig:
    return RunConfig.model_validate({"model": {"architecture": TINY, **model}})


def test_model_config_from_inline_architecture_takes_vocab_from_tokenizer():
    cfg = model_mod.model_config(config(), vocab_size=300, special_tokens={"eos_token_id": 0, "pad_token_id": 0})
    assert cfg.model_type == "gpt2" and cfg.vocab_size == 300 and cfg.n_layer == 2
    assert cfg.eos_token_id == 0 and cfg.use_cache is False
    assert model_mod.shape_of(cfg) == (2, 32)


def test_classification_config_carries_labels():
    cfg = model_mod.model_config(config(task="sequence-classification"), 300, label_names=["neg", "pos", "mixed"])
    assert cfg.num_labels == 3 and cfg.id2label == {0: "neg", 1: "pos", 2: "mixed"}


def test_architecture_needs_a_model_type():
    bad = RunConfig.model_validate({"model": {"architecture": {"n_layer": 2}}})
    with pytest.raises(UserError, match="model.architecture"):
        model_mod.model_config(bad, 300)


def test_build_from_scratch_and_on_meta():
    model = model_mod.build_model(config(), vocab_size=300)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.get_input_embeddings().num_embeddings == 300
    meta = model_mod.build_model(config(), vocab_size=300, device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert model_mod.flop_params(meta) == model_mod.flop_params(model)


def test_flop_params_count_tied_embeddings_once_and_skip_positions():
    model = model_mod.build_model(config(), vocab_size=300)
    total = sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates ties
    assert model_mod.flop_params(model) == total - 64 * 32  # minus wpe


def test_local_directory_round_trip_and_from_scratch(tmp_path):
    torch.manual_seed(0)
    original = model_mod.build_model(config(), vocab_size=300)
    original.save_pretrained(tmp_path / "saved")
    loaded = model_mod.build_model(config(name_or_path=str(tmp_path / "saved")), vocab_size=300)
    for a, b in zip(original.state_dict().values(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b)
    fresh = model_mod.build_model(config(name_or_path=str(tmp_path / "saved"), from_scratch=True), vocab_size=300)
    assert not torch.equal(fresh.transformer.h[0].attn.c_attn.weight, original.transformer.h[0].attn.c_attn.weight)


def test_remote_code_stays_off_unless_asked(tmp_path, monkeypatch):
    import transformers

    model_mod.build_model(config(), vocab_size=300).save_pretrained(tmp_path / "saved")
    seen = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    model_mod.build_model(config(name_or_path=str(tmp_path / "saved")), vocab_size=300)
    model_mod.build_model(config(name_or_path=str(tmp_path / "saved"), trust_remote_code=True), vocab_size=300)
    assert seen == [False, True]


def test_larger_tokenizer_grows_the_embeddings(tmp_path):
    model_mod.build_model(config(), vocab_size=300).save_pretrained(tmp_path / "saved")
    grown = model_mod.build_model(config(name_or_path=str(tmp_path / "saved")), vocab_size=310)
    assert grown.get_input_embeddings().num_embeddings >= 310


def test_gradient_checkpointing_option():
    model = model_mod.build_model(config(gradient_checkpointing=True), vocab_size=300)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    model.train()
    ids = torch.randint(0, 300, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.transformer.h[0].mlp.c_fc.weight.grad is not None


def test_sequence_classification_head():
    cfg = config(task="sequence-classification")
    model = model_mod.build_model(cfg, vocab_size=300, label_names=["a", "b"], special_tokens={"pad_token_id": 0})
    out = model(input_ids=torch.tensor([[5, 6, 0, 0]]), labels=torch.tensor([1]))
    assert out.logits.shape == (1, 2) and out.loss.ndim == 0
