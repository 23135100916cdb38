"""Distillation (`distill.*`, training/objectives/distill.py): the loss is TRL's generalized_jsd_loss on the same
batch, normalised over the global batch's loss tokens, and what is not built yet is refused by key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import cfg_of
from hf_fixtures import OneProcessAccelerator, make_student_and_teacher, make_tiny_model
from overdrive.errors import UserError

pytest.importorskip("trl")


def _trl_loss():
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill")
    make_student_and_teacher(root)
    make_tiny_model(root / "other")  # GPT-2 with another word list: another tokenizer
    return root


def _batch(rows: int = 4, length: int = 12, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 37, (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: no loss there, as chat's assistant-only labels
    labels[1, 8:] = -100  # rows of different loss lengths: the token count, not the row count, divides
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_divergence_is_trls_generalized_jsd_loss(beta, temperature):
    from overdrive.training.objectives import distill_loss

    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(3, 7, 37, generator=generator), torch.randn(3, 7, 37, generator=generator) * 2
    labels = torch.randint(0, 37, (3, 7), generator=generator)
    labels[0, :3] = -100
    mask = labels != -100
    ours = distill_loss.per_token(student, teacher, beta, temperature)[mask].sum() / mask.sum()
    theirs = _trl_loss()(student, teacher, labels=labels, beta=beta, temperature=temperature)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())), (ours, theirs)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_top_k_divergence_is_trls_over_the_teachers_k_ids(beta):
    """distill.top_k: TRL's function on the student's logits at the teacher's k ids and the teacher's
    top-k log-probabilities, both renormalised over those k (the mass outside them dropped)."""
    from overdrive.training.objectives import distill_loss

    generator = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(2, 6, 37, generator=generator), torch.randn(2, 6, 37, generator=generator) * 3
    labels = torch.randint(0, 37, (2, 6), generator=generator)
    ids, logprobs = distill_loss.top_k(teacher, 5)
    assert logprobs.dtype == torch.float16 and (ids[..., 0] == teacher.argmax(-1)).all()
    ours = distill_loss.per_token_top_k(student, ids, logprobs, beta, 2.0).mean()
    theirs = _trl_loss()(student.gather(-1, ids), logprobs.float(), labels=labels, beta=beta, temperature=2.0)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())), (ours, theirs)


def _objective(models: Path, *items: str):
    from overdrive.training.objectives import distill

    cfg = cfg_of(f"model.name_or_path={models / 'student'}", f"distill.teacher={models / 'teacher'}",
                 "model.from_scratch=false", *items)
    return cfg, distill.DistillObjective(cfg, OneProcessAccelerator(), distill.load_teacher(cfg, "cpu"))


@pytest.mark.parametrize("loss, beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5)])
def test_step_one_loss_is_trls_on_the_same_batch(models, loss, beta):
    """The objective's share of the step with the global token count equals TRL's GKDTrainer loss
    (its shift, its mask, its normalisation) on the same student, teacher and batch."""
    from transformers import AutoModelForCausalLM

    from overdrive.training.step import step_loss

    _, objective = _objective(models, f"distill.loss={loss}", "distill.temperature=2.0")
    student = AutoModelForCausalLM.from_pretrained(models / "student")
    batch = _batch()
    ours = step_loss.share(objective.sums(student, batch), objective.counts(batch).float())
    with torch.no_grad():
        teacher_logits = objective.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    student_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    theirs = _trl_loss()(student_logits[:, :-1, :], teacher_logits[:, :-1, :], labels=batch["labels"][:, 1:],
                         beta=beta, temperature=2.0)
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())
    assert objective.teacher.training is False and not any(p.requires_grad for p in objective.teacher.parameters())
    metrics = objective.read()
    assert set(metrics) == {"distill/loss", "distill/cross_entropy", "distill/top1_agreement"}
    assert abs(metrics["distill/loss"] - theirs.item()) <= 1e-5 and 0.0 <= metrics["distill/top1_agreement"] <= 1.0


def test_the_split_does_not_change_the_loss_or_the_gradient(models):
    """micro 4 x accumulation 1 == micro 2 x accumulation 2: each micro-batch's share is its summed
    loss over the global batch's tokens, with the data's cross entropy mixed in by alpha."""
    from transformers import AutoModelForCausalLM

    from overdrive.training.step import step_loss

    _, objective = _objective(models, "distill.alpha=0.25", "distill.temperature=1.5")
    batch = _batch(seed=3)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]

    def run(micro_batches):
        student = AutoModelForCausalLM.from_pretrained(models / "student")
        totals = sum(objective.counts(b) for b in micro_batches).float().reshape(1)
        loss = sum(step_loss.share(objective.sums(student, b), totals) for b in micro_batches)
        loss.backward()
        return loss.item(), torch.cat([p.grad.reshape(-1) for p in student.parameters()])

    whole, split = run([batch]), run(halves)
    assert abs(whole[0] - split[0]) <= 1e-6 and torch.allclose(whole[1], split[1], atol=1e-6)
    metrics = objective.read()
    assert metrics["distill/cross_entropy"] > metrics["distill/loss"] > 0


def _problems(*items: str) -> dict[str, str]:
    with pytest.raises(UserError) as raised:
        cfg_of("model.name_or_path=org/student", "model.from_scratch=false", "distill.teacher=org/teacher", *items)
    return {p.key: p.message for p in raised.value.problems}


@pytest.mark.parametrize("items, key", [
    (("distill.lmbda=0.5", "data.document_mask=true"), "distill.lmbda"),
    (("distill.loss=forward_kl", "distill.beta=0.5"), "distill.beta"),
    (("preference.method=dpo", "data.format=preference", "data.packing=false"), "preference.method"),
    (("model.task=sequence-classification",), "model.task"),
    (("training.micro_batch_size=auto",), "training.micro_batch_size"),
    (("training.loss_kernel=chunked",), "training.loss_kernel"),
    (("parallel.pp_size=2", "launch.num_processes=2"), "parallel.pp_size"),
    (("parallel.tp_size=2", "launch.num_processes=2"), "parallel.tp_size"),
])
def test_what_is_not_built_is_refused_by_key(items, key):
    assert key in _problems(*items)


def test_the_layouts_are_accepted_the_sharded_ones_with_the_teacher_sharded_too():
    for items in ((), ("parallel.strategy=ddp", "launch.num_processes=2"),
                  ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2", "launch.num_processes=2"),
                  ("parallel.strategy=fsdp", "launch.num_processes=2"),
                  ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "launch.num_processes=2"),
                  ("parallel.strategy=fsdp", "launch.num_processes=2", "distill.lmbda=0.5"),
                  ("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "launch.num_processes=2",
                   "distill.lmbda=1"),
                  ("parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "launch.num_processes=4"),
                  ("peft.method=lora",), ("training.loss_spike.factor=3",), ("training.oom_retry=true",),
                  ("training.activation_offloading=true",), ("data.document_mask=true",)):
        cfg = cfg_of("model.name_or_path=org/student", "model.from_scratch=false", "distill.teacher=org/teacher",
                     *items)
        assert cfg.distill.teacher == "org/teacher"


def test_a_teacher_with_another_tokenizer_is_refused_by_key_from_its_files(models):
    from overdrive.hf import teacher

    cfg = cfg_of(f"model.name_or_path={models / 'student'}", "model.from_scratch=false",
                 f"distill.teacher={models / 'other'}")
    found = teacher.fit_problems(cfg)
    assert [p.key for p in found] == ["distill.teacher"] and "different tokenizer" in found[0].message
    same = cfg_of(f"model.name_or_path={models / 'student'}", "model.from_scratch=false",
                  f"distill.teacher={models / 'teacher'}")
    assert teacher.fit_problems(same) == []
    too_many = cfg_of(f"model.name_or_path={models / 'student'}", "model.from_scratch=false",
                      f"distill.teacher={models / 'teacher'}", "distill.top_k=99")
    assert [p.key for p in teacher.fit_problems(too_many)] == ["distill.top_k"]


def test_distill_keys_without_a_teacher_are_said_to_do_nothing():
    from overdrive.resolving import resolve

    resolved = resolve([], cli=["distill.alpha=0.5"], env={}, accelerate_default=False)
    assert any(w.key == "distill.alpha" for w in resolved.warnings)


def test_plan_counts_the_teachers_parameters(models):
    from overdrive.memory.model_shape import run_setup, teacher_params_of_run

    cfg = cfg_of(f"model.name_or_path={models / 'student'}", "model.from_scratch=false",
                 f"distill.teacher={models / 'teacher'}", "training.micro_batch_size=2")
    from transformers import AutoModelForCausalLM

    expected = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(models / "teacher").parameters())
    assert teacher_params_of_run(cfg) == expected
    setup = run_setup(cfg, "cpu")
    assert setup.teacher_params == expected and setup.teacher_bytes == 4 and setup.logits_held


def test_the_estimate_divides_the_teacher_as_the_student_is_sharded():
    """Whole on every DDP rank; over every rank under FSDP2 and ZeRO-3; under HSDP over one replica's ranks."""
    from overdrive.memory.estimator import estimate_row
    from overdrive.memory.shape import ModelShape, Setup

    student = ModelShape(name="s", model_type="llama", params=4096, param_shapes=((64, 32), (32, 32), (32, 32)),
                         layers=2, hidden=32, heads=2, kv_heads=2, intermediate=64, vocab=64, block_params=1024,
                         root_params=2048, largest_module_params=2048, autocast_params=4096)

    def teacher_bytes(strategy: str, **setup) -> int:
        row = estimate_row(strategy, student, Setup(teacher_params=1_000_000, teacher_bytes=2, **setup))
        return next(n for target, what, n in row.terms if what.startswith("teacher:"))

    assert teacher_bytes("ddp", devices=4) == 2_000_000
    assert teacher_bytes("fsdp2", devices=4) == teacher_bytes("zero3", devices=4) == 500_000
    assert teacher_bytes("fsdp2", devices=4, dp_replicate=2) == 1_000_000
