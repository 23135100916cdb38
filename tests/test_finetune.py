"""Fine-tuning without starting a process: the peft section's rules, chat rendering and its
loss mask, packing kept apart by the model's own attention, and the adapter's memory terms."""

from __future__ import annotations

import json

import pytest

from hf_fixtures import CHAT_TEMPLATE, CHAT_TEMPLATE_GENERATION, make_chat_data, make_tiny_llama
from overdrive.resolving import resolve
from overdrive.errors import UserError


def keys_of(error: UserError) -> list[str]:
    return [p.key for p in error.problems]


def test_lora_rank_below_one_and_adapter_on_random_weights_are_refused_by_key():
    with pytest.raises(UserError) as error:
        resolve([], cli=["peft.method=lora", "peft.r=0"])
    assert "peft.r" in keys_of(error.value)
    with pytest.raises(UserError) as error:
        resolve([], cli=["peft.method=lora"])
    assert keys_of(error.value) == ["peft.method"]
    assert "model.name_or_path" in error.value.render()


def test_target_modules_that_match_nothing_name_the_linear_layers(llama):
    from overdrive.training.build import adapter

    cfg = resolve([], cli=[f"model.name_or_path={llama}", "peft.method=lora", "peft.target_modules=[q_projj,v_proj]",
                           "peft.modules_to_save=[head]"]).config
    with pytest.raises(UserError) as error:
        adapter.check(cfg)
    assert keys_of(error.value) == ["peft.target_modules", "peft.modules_to_save"]
    text = error.value.render()
    assert "did you mean 'q_proj'?" in text and "gate_proj" in text and "'head'" in text
    adapter.check(resolve([], cli=[f"model.name_or_path={llama}", "peft.method=lora"]).config)  # all-linear fits


def test_bad_input_exits_2_by_key_without_a_traceback(llama, tmp_path, capsys):
    from overdrive.cli import main

    bare = make_tiny_llama(tmp_path / "bare", chat_template=None)
    data = make_chat_data(tmp_path / "chat.jsonl", rows=4)
    common = [f"data.source={data}", "data.format=chat", f"output_dir={tmp_path / 'out'}", "launch.use_cpu=true"]
    cases = {
        "peft.r": [f"model.name_or_path={llama}", "peft.method=lora", "peft.r=0"],
        "peft.target_modules": [f"model.name_or_path={llama}", "peft.method=lora", "peft.target_modules=[qproj]"],
        "tokenizer.chat_template": [f"model.name_or_path={bare}", "peft.method=lora"],
    }
    for key, items in cases.items():
        assert main(["train", *common, *items]) == 2, key
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err, err


def test_a_chat_row_without_an_assistant_turn_is_refused_by_key(llama, tmp_path):
    from overdrive.data import prepare
    from overdrive.training.build.tokenizer import build_tokenizer

    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "yes"}]},
            {"messages": [{"role": "user", "content": "c d"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve([], cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=chat",
                           f"data.cache_dir={tmp_path / 'cache'}"]).config
    with pytest.raises(UserError) as error:
        prepare(cfg, build_tokenizer)
    assert keys_of(error.value) == ["data.messages_column"]
    assert "row 1" in error.value.render() and "assistant" in error.value.render()


def test_the_tokenizers_template_or_the_keys(llama, tmp_path):
    from transformers import AutoTokenizer

    from overdrive.data.chat import with_template

    bare = AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path / "bare", chat_template=None))
    cfg = resolve([], cli=["data.format=chat", "model.name_or_path=bare"]).config
    with pytest.raises(UserError) as error:
        with_template(cfg, bare, "bare")
    assert keys_of(error.value) == ["tokenizer.chat_template"]
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = resolve([], cli=["data.format=chat", "model.name_or_path=bare", f"tokenizer.chat_template={template}"]).config
    assert with_template(cfg, bare, "bare").chat_template == CHAT_TEMPLATE


def _masked_words(tokenizer, ids, mask) -> str:
    return " ".join(tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]))


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHAT_TEMPLATE_GENERATION], ids=["prefixes", "generation"])
def test_the_loss_mask_covers_the_assistants_turns_only(llama, template):
    from transformers import AutoTokenizer

    from overdrive.data.chat import ChatEncoder

    tokenizer = AutoTokenizer.from_pretrained(llama)
    tokenizer.chat_template = template
    turns = [{"role": "system", "content": "ok"}, {"role": "user", "content": "a b c"},
             {"role": "assistant", "content": "the answer"}, {"role": "user", "content": "d"},
             {"role": "assistant", "content": "is yes"}]
    encoder = ChatEncoder(tokenizer, max_length=64)
    ids, mask = encoder.encode(turns)
    assert _masked_words(tokenizer, ids, mask) == "the answer <eos> is yes <eos>"
    assert len(ids) == len(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"])
    assert sum(ChatEncoder(tokenizer, 64, train_on_prompt=True).encode(turns)[1]) == len(ids)


def test_overlong_conversations_are_truncated_or_dropped_and_counted(llama):
    from transformers import AutoTokenizer

    from overdrive.data.chat import ChatEncoder, describe_counts

    tokenizer = AutoTokenizer.from_pretrained(llama)
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "yes"}]
    long = [{"role": "user", "content": " ".join("abcdefghijklmnop")}, {"role": "assistant", "content": "yes"}]
    cut = ChatEncoder(tokenizer, max_length=12)
    assert [len(r[0]) for r in cut([short, long, long])] == [6, 12, 12]
    drop = ChatEncoder(tokenizer, max_length=12, overlong="drop")
    assert drop([short, long])[1] is None
    assert (cut.counts["truncated"], drop.counts["dropped"]) == (2, 1)
    assert "2 longer than 12 tokens truncated" in describe_counts(cut.summary()["chat"])


def test_packed_conversations_do_not_attend_to_each_other(llama):
    """The loss of a conversation packed behind another equals its loss alone: the position ids
    that restart make Transformers' attention block-diagonal."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from overdrive.data.chat_samples import ChatCollator, Conversations, PackedConversations, packing_note

    ids = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], dtype=np.uint16)
    mask = np.array([0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1], dtype=np.uint8)
    rows = Conversations(ids, np.array([4, 11]), mask)
    packed = PackedConversations(rows, block=16)
    assert len(packed) == 1
    row = packed[0]
    assert row["position_ids"][:11].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]
    model = AutoModelForCausalLM.from_pretrained(llama, use_cache=False).eval()  # as the run builds it
    assert packing_note(model) == ""

    def token_losses(batch):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, batch["labels"][0, 1:], reduction="none")

    with torch.no_grad():
        together = token_losses(ChatCollator(0)([row]))
        alone = token_losses(ChatCollator(0)([rows[1]]))
        leaked = token_losses({"input_ids": row["input_ids"][None], "labels": row["labels"][None]})
    assert torch.allclose(together[4:10], alone, atol=1e-5)
    assert not torch.allclose(leaked[4:10], alone, atol=1e-3)  # without the restart it would attend back


def test_adapter_memory_counts_gradients_and_optimizer_for_the_adapter_only():
    from transformers import LlamaConfig

    from overdrive.config.schema_peft import PeftConfig
    from overdrive.memory import Setup, estimate
    from overdrive.memory.adapter import adapter_shape
    from overdrive.memory.model_shape import build_meta_model, shape_of_model

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    shape = shape_of_model(build_meta_model(config), "llama")
    lora = adapter_shape(build_meta_model(config), PeftConfig(method="lora", r=8), base_bytes=2)
    # r x (in + out) for each of the 7 linear layers of 4 blocks.
    per_block = 8 * ((256 + 256) * 2 + (256 + 128) * 2 + (256 + 512) * 2 + (512 + 256))
    assert lora.trainable == 4 * per_block
    full = estimate(shape, Setup(devices=1, precision="bf16"), ("ddp",)).row("ddp")
    row = estimate(shape, Setup(devices=1, precision="bf16", adapter=lora), ("ddp",)).row("ddp")
    assert row.grads_bytes == 4 * lora.trainable and row.optimizer_bytes == 8 * lora.trainable
    assert row.params_bytes == 2 * shape.params + 4 * lora.trainable
    assert row.total_bytes < full.total_bytes
    qlora = adapter_shape(build_meta_model(config), PeftConfig(method="qlora", r=8), base_bytes=2)
    qrow = estimate(shape, Setup(devices=1, precision="bf16", adapter=qlora), ("ddp",)).row("ddp")
    assert qrow.params_bytes < row.params_bytes / 2
    sharded = estimate(shape, Setup(devices=4, precision="bf16", adapter=lora), ("fsdp2",)).row("fsdp2")
    assert sharded.optimizer_bytes == pytest.approx(8 * lora.trainable / 4, abs=1)


def test_what_each_strategy_refuses_or_sets_for_an_adapter(llama):
    from overdrive.strategies import adapter as strategy_adapter

    def cfg(*items):
        return resolve([], cli=[f"model.name_or_path={llama}", *items]).config

    assert strategy_adapter.quant_storage_dtype(cfg("peft.method=qlora")) == "uint8"
    assert strategy_adapter.quant_storage_dtype(cfg("peft.method=qlora", "parallel.strategy=fsdp")) == "float32"
    assert strategy_adapter.checkpoint_writer(cfg("peft.method=lora", "parallel.strategy=deepspeed")) == "engine"
    for items, key in ((["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"], "peft.method"),
                       (["parallel.strategy=fsdp", "peft.storage_dtype=uint8"], "peft.storage_dtype"),
                       (["parallel.strategy=fsdp", "peft.bits=8"], "peft.bits")):
        with pytest.raises(UserError) as error:
            cfg("peft.method=qlora", *items)
        assert keys_of(error.value) == [key]
    with pytest.raises(UserError) as error:
        cfg("peft.method=lora", "parallel.strategy=fsdp", "parallel.fsdp.version=1", "parallel.fsdp.use_orig_params=false")
    assert keys_of(error.value) == ["parallel.fsdp.use_orig_params"]


def test_packed_4bit_weights_are_stored_in_the_dtype_the_strategy_casts_to(llama):
    """FSDP2 (bf16/fp16 MixedPrecisionPolicy) and DeepSpeed's bf16/fp16 engine cast every float
    parameter: 4-bit bytes packed into another float dtype would be value-cast into garbage."""
    from overdrive.strategies import adapter as strategy_adapter

    def cfg(*items):
        return resolve([], cli=[f"model.name_or_path={llama}", "peft.method=qlora", *items]).config

    fsdp = ("parallel.strategy=fsdp",)
    assert strategy_adapter.quant_storage_dtype(cfg(*fsdp, "precision.mixed_precision=bf16")) == "bfloat16"
    assert strategy_adapter.quant_storage_dtype(cfg(*fsdp, "precision.mixed_precision=fp16")) == "float16"
    assert strategy_adapter.quant_storage_dtype(cfg(*fsdp, "precision.mixed_precision=no")) == "float32"
    # uint8 (DeepSpeed's auto) is no float: the engine leaves it alone.
    zero2 = ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2", "precision.mixed_precision=bf16")
    assert strategy_adapter.quant_storage_dtype(cfg(*zero2)) == "uint8"
    assert strategy_adapter.quant_storage_dtype(cfg(*zero2, "peft.storage_dtype=bfloat16")) == "bfloat16"
    for items in ((*zero2, "peft.storage_dtype=float32"), (*fsdp, "precision.mixed_precision=bf16",
                                                           "peft.storage_dtype=float16")):
        with pytest.raises(UserError) as error:
            cfg(*items)
        assert keys_of(error.value) == ["peft.storage_dtype"], items
        assert "value-cast" in str(error.value)
    # Without mixed precision nothing casts: an explicit float32 stays allowed.
    assert strategy_adapter.quant_storage_dtype(cfg(*zero2[:2], "precision.mixed_precision=no",
                                                    "peft.storage_dtype=float32")) == "float32"
