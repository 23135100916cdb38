"""An adapter that exists: trained on from `peft.adapter_path` (its config checked by key), and
merged into its base by `overdrive merge` without a run. The fresh run counts its steps in
epochs (`training.num_epochs`), from the token cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fixtures import make_chat_data, make_tiny_llama
from overdrive.resolving import resolve
from overdrive.errors import UserError

RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0.0", "peft.method=lora", "peft.r=4",
       "peft.alpha=8", "training.micro_batch_size=4", "training.log_every_steps=1", "training.eval_every_steps=null",
       "optim.lr=0.02", "scheduler.name=constant", "scheduler.warmup_steps=0", "launch.use_cpu=true",
       "logging.trackers=[none]", "logging.progress=false", "checkpoint.enabled=false"]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and json.loads(line).get("loss") is not None]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    from overdrive.cli import main

    root = tmp_path_factory.mktemp("adapter")
    make_tiny_llama(root / "base")
    make_chat_data(root / "chat.jsonl", rows=48)
    common = [f"model.name_or_path={root / 'base'}", f"data.source={root / 'chat.jsonl'}",
              f"data.cache_dir={root / 'cache'}", *RUN]
    assert main(["train", *common, "training.num_epochs=1.5", "scheduler.warmup_ratio=0.25",
                 f"output_dir={root / 'fresh'}"]) == 0
    return root, common


@pytest.mark.slow
def test_epochs_count_the_steps_from_the_token_cache(fresh):
    root, _ = fresh
    resolved = json.loads((root / "fresh" / "resolved.json").read_text())
    # 48 conversations / global batch 4 = 12 steps per epoch; 1.5 epochs = 18 steps; warmup ceil(0.25 x 18) = 5
    assert resolved["config"]["training"]["max_steps"] == 18
    assert resolved["config"]["scheduler"]["warmup_steps"] == 5
    assert "num_epochs" in json.dumps(resolved["origins"]["training.max_steps"])
    assert len(losses(root / "fresh")) == 18


@pytest.mark.slow
def test_a_run_continued_from_the_adapter_starts_where_it_ended(fresh):
    from overdrive.cli import main

    root, common = fresh
    first_fresh = losses(root / "fresh")[0]
    assert main(["train", *common, "training.max_steps=2", f"peft.adapter_path={root / 'fresh' / 'model'}",
                 f"output_dir={root / 'continued'}"]) == 0
    first_continued = losses(root / "continued")[0]
    print(f"first loss: fresh {first_fresh:.4f}, continued {first_continued:.4f}")
    assert first_continued < 0.9 * first_fresh
    with pytest.raises(UserError) as error:  # the config says another rank than the adapter has
        resolve([], cli=[*common, "peft.r=8", f"peft.adapter_path={root / 'fresh' / 'model'}"], env={},
                accelerate_default=False)
    assert [p.key for p in error.value.problems] == ["peft.r"]


@pytest.mark.slow
def test_merge_writes_the_model_peft_computes(fresh, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from overdrive.cli import main

    root, _ = fresh
    adapter, merged = root / "fresh" / "model", root / "merged"
    assert main(["merge", str(adapter), "-o", str(merged), "--base", str(root / "base")]) == 0
    ids = torch.tensor([[3, 4, 5, 9, 12, 20, 2]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), str(adapter))(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
    difference = (peft_logits - merged_logits).abs().max().item()
    with capsys.disabled():
        print(f"merged vs PeftModel logits: max difference {difference:.2e}")
    assert difference < 1e-4
    assert main(["merge", str(adapter), "-o", str(merged)]) == 2  # the base from adapter_config.json; DIR kept
    assert "--force" in capsys.readouterr().err
    assert main(["merge", str(adapter), "-o", str(merged), "--force"]) == 0
