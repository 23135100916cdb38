"""The composed step and the table of what composes (resolving/composition.py).

In-process: every objective's loss of a step is the same whatever the split (8 x 1 = 1 x 8 = a
simulated 2 ranks x 1 x 4), ORPO, SimPO and the reward model included; the combinations that do
not compose are refused by `explain` naming a key; docs/compatibility.md is the table's own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from overdrive import cli
from overdrive.config.schema import RunConfig
from overdrive.training.step import step_loss
from overdrive.training.objectives.objective import TokenObjective
from overdrive.training.objectives.preference import PreferenceObjective

REPO = Path(__file__).resolve().parents[1]
VOCAB, ROWS, LENGTH = 23, 8, 12


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), is_main_process=True, num_processes=1,
                           reduce=lambda tensor, how: tensor)


def _tiny(task: str = "causal-lm"):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, pad_token_id=0, num_labels=1)
    return (LlamaForSequenceClassification if task == "sequence-classification" else LlamaForCausalLM)(config)


def _rows(kind: str) -> dict:
    """ROWS rows of LENGTH right-padded tokens: text (every token in the loss), chat (answers of
    varying length in the loss), pairs (chosen rows then rejected rows, answers of varying length)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    lengths = torch.randint(5, LENGTH + 1, (ROWS,), generator=g)
    real = torch.arange(LENGTH)[None, :] < lengths[:, None]
    ids = ids.where(real, torch.zeros_like(ids))
    labels = ids.where(real, torch.full_like(ids, step_loss.IGNORE))
    if kind != "text":  # a prompt of 3 tokens out of the loss
        labels[:, :3] = step_loss.IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": real.long()}


def _micro_batches(batch: dict, micro: int, pairs: bool) -> list[dict]:
    """The batch cut into micro-batches of `micro` rows (of `micro` pairs: chosen and rejected kept together)."""
    if not pairs:
        return [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, ROWS, micro)]
    n = ROWS // 2
    return [{k: torch.cat([v[i:i + micro], v[n + i:n + i + micro]]) for k, v in batch.items()}
            for i in range(0, n, micro)]


def _step_loss(objective, model, micro_batches: list[dict], ranks: int = 1) -> float:
    """The loop's arithmetic for one step: the global counts, then each micro-batch's share; a
    simulated data-parallel world adds its ranks' shares (the all-reduce of the gradients' mean)."""
    totals = sum(objective.counts(b).reshape(-1) for b in micro_batches).clamp(min=1).float()
    per_rank = len(micro_batches) // ranks
    shares = [sum(step_loss.share(objective.sums(model, b), totals) for b in micro_batches[r * per_rank:(r + 1) * per_rank])
              for r in range(ranks)]
    return float(sum(shares))


def _cfg(*items: str) -> RunConfig:
    from overdrive.resolving import load_config

    return load_config(cli=["model.name_or_path=org/pretrained", *items], env={})


@pytest.mark.parametrize("objective", ["text", "chat", "dpo", "ipo", "orpo", "simpo", "reward"])
def test_every_objectives_step_loss_is_the_same_whatever_the_split(objective):
    pairs = objective not in ("text", "chat")
    task = "sequence-classification" if objective == "reward" else "causal-lm"
    model = _tiny(task)
    if pairs:
        items = ["data.format=preference", f"preference.method={objective}", "data.packing=false", f"model.task={task}"]
        def reference(model, batch):  # a fixed reference log-prob per row
            return -batch["input_ids"].sum(dim=1).float() / 50

        obj = PreferenceObjective(_cfg(*items), _accelerator(), reference=reference)
    else:
        obj = TokenObjective("causal-lm")
    batch = _rows("text" if objective == "text" else "chat")
    rows = ROWS // 2 if pairs else ROWS
    whole = _step_loss(obj, model, _micro_batches(batch, rows, pairs))
    one_by_one = _step_loss(obj, model, _micro_batches(batch, 1, pairs))
    two_ranks = _step_loss(obj, model, _micro_batches(batch, 1, pairs), ranks=2)
    assert whole == pytest.approx(one_by_one, rel=1e-6, abs=1e-7)
    assert whole == pytest.approx(two_ranks, rel=1e-6, abs=1e-7)
    if objective in ("dpo", "ipo", "orpo", "simpo", "reward"):
        assert whole > 0


def test_orpo_is_trls_mean_nll_over_the_batchs_chosen_tokens_plus_the_mean_odds_ratio_term():
    from overdrive.training.objectives import preference_loss as losses
    from overdrive.training.objectives.preference import sequence_scores

    model = _tiny()
    batch = _rows("chat")
    obj = PreferenceObjective(_cfg("data.format=preference", "preference.method=orpo", "data.packing=false"),
                              _accelerator())
    got = _step_loss(obj, model, _micro_batches(batch, 1, pairs=True))
    logps, lengths, per_token = sequence_scores(model, batch)
    n = ROWS // 2
    real = batch["attention_mask"][:n, 1:].float()
    nll = -(per_token[:n] * real).sum() / real.sum()  # TRL's ORPOTrainer: the mean over the batch's chosen tokens
    expected = losses.orpo(logps[:n], logps[n:], lengths[:n], lengths[n:], nll, 0.1).losses.mean()
    assert got == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("items, key", [
    (("data.format=preference", "preference.method=dpo", "parallel.pp_size=2"), "parallel.pp_size"),
    (("data.format=preference", "preference.method=orpo", "parallel.pp_size=2"), "parallel.pp_size"),
    (("data.format=preference", "preference.method=dpo", "parallel.strategy=fsdp", "parallel.cp_size=2",
      "launch.gpus_per_machine=2", "preference.precompute_reference=true"), "parallel.cp_size"),
    (("data.format=preference", "preference.method=reward", "model.task=sequence-classification",
      "parallel.strategy=fsdp", "parallel.tp_size=2"), "parallel.tp_size"),
    (("parallel.strategy=fsdp", "parallel.cp_size=2", "launch.use_cpu=true"), "parallel.cp_size"),
    (("model.attn_implementation=flash_attention_2", "launch.use_cpu=true"), "model.attn_implementation"),
    (("data.format=preference", "preference.method=dpo", "parallel.strategy=fsdp", "parallel.ep_size=2"),
     "parallel.ep_size"),
])
def test_what_does_not_compose_is_refused_by_explain_naming_the_key(items, key, capsys):
    code = cli.main(["explain", "model.name_or_path=org/pretrained", "data.packing=false",
                     "launch.num_processes=2", *items])
    err = capsys.readouterr().err
    assert code == 2 and f"{key}:" in err and "fix:" in err and "Traceback" not in err


def test_an_attention_kernel_this_machine_cannot_load_is_refused_before_training_with_sdpa_as_the_fix():
    from overdrive.resolving import composition

    cfg = _cfg("model.attn_implementation=flash_attention_2")
    found = composition.attention_problems(cfg, lambda key: "file:3", on_cpu=True)
    assert [p.key for p in found] == ["model.attn_implementation"]
    assert "model.attn_implementation=sdpa" in found[0].fix and found[0].where == "file:3"
    assert composition.attention_problems(_cfg("model.attn_implementation=sdpa"), lambda key: "", on_cpu=True) == []


def test_the_compatibility_page_is_the_tables_own():
    from overdrive.resolving.compatibility import markdown

    assert (REPO / "docs" / "compatibility.md").read_text() == markdown(), (
        "docs/compatibility.md is stale: python -m overdrive.resolving.compatibility > docs/compatibility.md")


def test_the_dpo_starting_point_is_accepted_as_written_and_the_pretraining_defaults_are_said(capsys):
    from overdrive.resolving.inputs import resolve_items

    resolved = resolve_items([str(REPO / "configs" / "dpo-lora.yaml"), "model.name_or_path=org/sft",
                              "data.source=pairs.jsonl"], tell=False)
    assert not [p for p in resolved.warnings if p.key in ("optim.lr", "training.max_steps")]
    bare = resolve_items(["model.name_or_path=org/sft", "data.source=pairs.jsonl", "data.format=preference",
                          "preference.method=dpo"], tell=False)
    assert {"optim.lr", "training.max_steps"} <= {p.key for p in bare.warnings}


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges a machine without a GPU")
def test_context_parallel_explained_on_a_machine_that_cannot_run_it_is_refused_as_train_refuses_it(capsys):
    items = ["parallel.strategy=fsdp", "parallel.cp_size=2", "launch.num_processes=2"]
    assert cli.main(["explain", *items]) == 2
    assert "parallel.cp_size:" in capsys.readouterr().err
    assert cli.main(["explain", *items, "launch.gpus_per_machine=2"]) == 0  # explained for GPU machines


def test_a_pipeline_step_padded_to_one_length_gives_the_token_mean_of_the_unpadded_micro_batches():
    """The pipeline's forward-backward pads each micro-batch to data.max_length (one tensor to split,
    stage messages of one size) and its last stage's loss of each microbatch is the summed token loss
    over the step's tokens: the shares add up to the one-process step loss of the unpadded rows."""
    from overdrive.training.step.pipeline import Pipeline, StepTokenMean

    model = _tiny()
    batch = _rows("chat")
    micro_batches = [{k: v[i:i + 2, : 6 + i] for k, v in batch.items()} for i in range(0, ROWS, 2)]  # ragged lengths
    expected = _step_loss(TokenObjective("causal-lm"), model, micro_batches)
    stage = SimpleNamespace(length=LENGTH + 4, pad_id=0)
    input_ids, labels = Pipeline.padded(stage, micro_batches)
    assert input_ids.shape == (ROWS, LENGTH + 4)
    loss = StepTokenMean()
    loss.tokens = sum(step_loss.loss_token_count(b) for b in micro_batches)
    with torch.no_grad():
        got = sum(loss(model(input_ids=input_ids[i:i + 2]).logits, labels[i:i + 2]) for i in range(0, ROWS, 2))
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_an_environment_beside_image_prompts_is_refused_as_tools_are():
    from overdrive.resolving import composition

    online = ("rl.method=grpo", "data.format=prompts", "rl.num_generations=2", "training.micro_batch_size=2",
              "rl.reward_funcs=[{function: exact_match}]")
    for item, key in (("rl.environment=my_env:Env", "rl.environment"), ("rl.tools=[my_tools:f]", "rl.tools")):
        # its reset, methods and reward would never run in GRPO's one image turn: refused, not ignored
        assert [p.key for p in composition.problems(_cfg(*online, item), vision=True)] == [key]
        assert composition.problems(_cfg(*online, item), vision=False) == []
