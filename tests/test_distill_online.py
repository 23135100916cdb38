"""On-policy distillation (distill.lmbda, training/objectives/distill_policy.py) and the teacher's top-k cache
(distill.top_k, data/teacher_cache.py, `overdrive distill-cache`), in this process: the coin and the
prompts are functions of what they are said to be, the on-policy samples are the student's own, and
a run that reads the cache never loads the teacher and gets the live top-k loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import cfg_of
from hf_fixtures import OneProcessAccelerator, make_student_and_teacher, write_letter_chat


def test_the_on_policy_coin_is_the_seed_and_step_and_lmbda_its_share():
    from overdrive.training.objectives.distill_policy import on_policy

    draws = [on_policy(7, step, 0.5) for step in range(1, 401)]
    assert draws == [on_policy(7, step, 0.5) for step in range(1, 401)]  # a resume decides as the first run did
    assert abs(sum(draws) / len(draws) - 0.5) < 0.08
    assert draws != [on_policy(8, step, 0.5) for step in range(1, 401)]
    assert all(on_policy(7, s, 1.0) for s in range(1, 50)) and not any(on_policy(7, s, 0.0) for s in range(1, 50))


def test_the_prompt_is_the_turns_before_the_last_answer_or_half_a_text_row():
    from overdrive.training.objectives.distill_policy import prompt_length

    chat = [-100, -100, 5, 6, -100, -100, -100, 9, 10, 11, -100]  # two answers, then padding
    assert prompt_length(chat, 10, chat=True) == 7
    assert prompt_length(list(range(12)), 12, chat=False) == 6


def test_a_rows_place_in_the_global_batch_is_the_same_whatever_the_split():
    """Its sample's seed: one process at micro 4, two at micro 2, two at micro 1 x accumulation 2."""
    from overdrive.training.objectives.distill_policy import row_numbers

    assert list(row_numbers(0, 1, 0, 4)) == [0, 1, 2, 3]
    assert [list(row_numbers(r, 2, 0, 2)) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [[row_numbers(r, 2, i, 1)[0] for i in (0, 1)] for r in (0, 1)] == [[0, 2], [1, 3]]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill-online")
    make_student_and_teacher(root)
    write_letter_chat(root / "chat.jsonl", 24)
    return root


def _cfg(work: Path, *items: str):
    return cfg_of(f"model.name_or_path={work / 'student'}", "model.from_scratch=false",
                  f"distill.teacher={work / 'teacher'}", f"data.source={work / 'chat.jsonl'}", "data.format=chat",
                  "data.packing=false", "data.max_length=48", f"data.cache_dir={work / 'cache'}",
                  "training.micro_batch_size=4", *items)


def _data(cfg):
    from overdrive import data as data_mod
    from overdrive.training.build.tokenizer import build_tokenizer

    tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer)
    collate = data_mod.collate_for(data_mod.sample_kind(cfg), tokenizer.pad_token_id, cfg.data.max_length)
    return tokenizer, tokens, collate([tokens.train[i] for i in range(4)])


@pytest.mark.slow
def test_with_lmbda_1_the_student_samples_the_answers_the_teacher_scores(work):
    from transformers import AutoModelForCausalLM

    from overdrive.training.generation import sampling

    from overdrive.training.objectives import distill, distill_policy

    cfg = _cfg(work, "distill.lmbda=1", "distill.max_new_tokens=8", "distill.temperature=1.0")
    tokenizer, tokens, batch = _data(cfg)
    objective = distill.objective(cfg, OneProcessAccelerator(), tokenizer, tokens)
    student = AutoModelForCausalLM.from_pretrained(work / "student")
    [sampled] = objective.prepare(student, [batch])
    prompts = objective.sampler.prompts(batch)
    # the prompt is kept (out of the loss); what follows it is the student's own: Transformers' generate drawing
    # row i's tokens alone from the seed of (seed, step 1, i), the draw the generation phase GRPO uses
    theirs = []
    for row, prompt in enumerate(prompts):
        ids, mask = sampling.left_padded([prompt], tokenizer.pad_token_id, "cpu")
        draw = sampling.GumbelDraw([distill_policy.sample_seed(cfg.training.seed, 1, row)], "cpu", 1.0)
        with torch.no_grad():
            theirs += student.generate(input_ids=ids, attention_mask=mask, do_sample=False, logits_processor=[draw],
                                       max_new_tokens=8, pad_token_id=tokenizer.pad_token_id,
                                       eos_token_id=tokenizer.eos_token_id)[:, ids.shape[1]:].tolist()
    differs = 0
    for row, prompt in enumerate(prompts):
        n = int(sampled["attention_mask"][row].sum())
        assert sampled["input_ids"][row, :len(prompt)].tolist() == prompt
        assert (sampled["labels"][row, :len(prompt)] == -100).all()
        mine = sampled["input_ids"][row, len(prompt):n].tolist()
        eos = next((i + 1 for i, t in enumerate(theirs[row]) if t == tokenizer.eos_token_id), len(theirs[row]))
        assert mine == theirs[row][:eos] and sampled["labels"][row, len(prompt):n].tolist() == mine
        data_answer = batch["input_ids"][row, len(prompt):len(prompt) + len(mine)].tolist()
        differs += mine != data_answer
    assert differs > 0  # not the data's answers
    loss = objective.sums(student, sampled)
    assert torch.isfinite(loss).all() and loss.item() > 0
    # a resumed run (its checkpoint's pending sums restored) prepares step 2 as the first run does
    resumed = distill.objective(cfg, OneProcessAccelerator(), tokenizer, tokens)
    resumed.restore(objective.pending())
    assert resumed.step == 1
    again, first = resumed.prepare(student, [batch])[0], objective.prepare(student, [batch])[0]
    assert all(torch.equal(again[k], first[k]) for k in first)
    metrics = objective.read()
    assert metrics["distill_on_policy"] == 1.0 and metrics["timing/generation_s"] > 0


@pytest.mark.slow
def test_a_cached_teacher_is_never_loaded_and_gives_the_live_top_k_loss(work, monkeypatch):
    from transformers import AutoModelForCausalLM

    from overdrive.commands.distill_cache import fill
    from overdrive.training.objectives import distill

    cfg = _cfg(work, "distill.top_k=5", "distill.temperature=2.0", "distill.alpha=0.25")
    tokenizer, tokens, batch = _data(cfg)
    student = AutoModelForCausalLM.from_pretrained(work / "student")
    live = distill.objective(cfg, OneProcessAccelerator(), tokenizer, tokens)  # no cache yet: the teacher scores
    assert live.cache is None and live.teacher is not None
    expected = live.sums(student, batch).item()
    assert fill(cfg, 3)[0] > 0 and fill(cfg, 3)[0] == 0  # written once, then found complete

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(distill, "load_teacher", refuse)
    cached = distill.objective(cfg, OneProcessAccelerator(), tokenizer, tokens)
    assert cached.cache is not None and cached.teacher is None
    assert abs(cached.sums(student, batch).item() - expected) <= 1e-5 * max(1.0, abs(expected))
    assert cached.read()["distill/top1_agreement"] == live.read()["distill/top1_agreement"]


@pytest.mark.slow
def test_a_stopped_cache_keeps_its_whole_shards_and_continues(work, monkeypatch):
    from overdrive.data import teacher_cache

    rows = [{"input_ids": torch.tensor([3 + i, 4, 5 + i % 7])} for i in range(7)]
    monkeypatch.setattr(teacher_cache, "ROWS_PER_SHARD", 3)
    calls = []

    def score(samples):
        calls.append(len(samples))
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped while scoring the second shard
        return [(torch.zeros(3, 2, dtype=torch.long), torch.full((3, 2), -0.5)) for _ in samples]

    path = work / "partial"
    with pytest.raises(KeyboardInterrupt):
        teacher_cache.write(path, rows, score, {"top_k": 2}, 3, lambda _: None)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("shard")) == ["shard-00000"]
    assert teacher_cache.write(path, rows, score, {"top_k": 2}, 3, lambda _: None) == 2  # the other two
    cache = teacher_cache.TeacherCache(path)
    ids, logprobs = cache.lookup({"input_ids": torch.stack([rows[5]["input_ids"], rows[0]["input_ids"]])})
    assert ids.shape == (2, 3, 2) and (logprobs == -0.5).all()
