"""Knowledge distillation as the composed step's objective (`distill.teacher`; training/objectives/objective.py):
the student's forward and the frozen teacher's on the same micro-batch (text or chat, whose labels
already mark the loss tokens: the assistant's alone for chat), and per loss token

    (1 - distill.alpha) x divergence(teacher, student)  +  distill.alpha x the data's cross entropy

summed over the micro-batch; step_loss.py divides by the global batch's loss tokens, so the loss
is the same whatever the split. The divergence is TRL's generalized_jsd_loss (distill_loss.py).

The teacher is loaded in the student's dtype, in eval mode (no dropout), with no gradients, and
placed as the student is (strategies/frozen.py): whole on every rank under DDP and ZeRO-1/2,
sharded layer by layer under FSDP2 and by DeepSpeed's engine under ZeRO-3, so no rank holds it
whole where the student is sharded. metrics.jsonl gets the divergence and the cross entropy
apart (`distill/loss`, `distill/cross_entropy`) and how often the two models' most likely next token
agree (`distill/top1_agreement`), summed on the device until the loop's log point reads them.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.config.schema_distill import effective_beta
from overdrive.errors import Problem, UserError
from overdrive.hf import teacher as teacher_files
from overdrive.strategies import frozen, registry
from overdrive.data import teacher_cache
from overdrive.training.objectives import distill_loss, distill_policy
from overdrive.training.step import step_loss
from overdrive.training.build.dtypes import DTYPES
from overdrive.training.objectives.objective import Objective, without_repeats

# metrics.jsonl's names, in the order of the summed tensor; the last slot counts loss tokens.
METRICS = ("distill/loss", "distill/cross_entropy", "distill/top1_agreement")
# Per step, the same on every rank: the share of on-policy steps and the seconds of each phase.
STEP_METRICS = ("distill_on_policy", "timing/generation_s", "timing/teacher_s")


def enabled(cfg: RunConfig) -> bool:
    return teacher_files.enabled(cfg)


def load_teacher(cfg: RunConfig, device: Any) -> torch.nn.Module:
    """The teacher's weights as the student's are loaded (dtype, attention kernel), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    from overdrive import hub

    m = cfg.model
    loading: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    if m.dtype != "auto":
        loading["dtype"] = DTYPES[m.dtype]
    if m.attn_implementation:
        loading["attn_implementation"] = m.attn_implementation
    with hub.reading(teacher_files.KEY, cfg.distill.teacher):
        teacher = AutoModelForCausalLM.from_pretrained(cfg.distill.teacher, **loading)
    teacher.config.use_cache = False  # the cache only serves generation
    teacher.requires_grad_(False)
    return teacher.to(device).eval()


class DistillObjective(Objective):
    """Logit distillation, off-policy or on-policy (distill_policy.py): a loss token is the unit, one term."""

    def __init__(self, cfg: RunConfig, accelerator: Any, teacher: Optional[torch.nn.Module],
                 cache: Optional["teacher_cache.TeacherCache"] = None,
                 sampler: Optional["distill_policy.Sampler"] = None):
        d = cfg.distill
        self.beta, self.temperature, self.alpha = effective_beta(d), d.temperature, d.alpha
        self.lmbda, self.top_k, self.seed = d.lmbda, d.top_k, cfg.training.seed
        self.accelerator, self.teacher, self.cache, self.sampler = accelerator, teacher, cache, sampler
        kind = "chat" if cfg.data.format == "chat" else "text"
        how = f", on-policy share {d.lmbda:g}" if d.lmbda else ""
        how += (f", top-{d.top_k} {'from the cache' if cache is not None else 'live'}") if d.top_k else ""
        self.name = f"{kind} distilled from {d.teacher} ({d.loss}, beta {self.beta:g}, alpha {self.alpha:g}{how})"
        self.sums_of_metrics = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)
        self.step = 0  # the steps prepared: the on-policy coin and the samples' seeds are drawn from it
        self.step_sums = [0.0] * (len(STEP_METRICS) + 1)  # the last counts steps

    # -------------------------------------------------------------- on-policy

    def prepare(self, model: Any, micro_batches: list) -> list:
        """With probability lmbda (from the seed and the step) the student's samples in place of the data's."""
        self.step += 1
        sampler = self.sampler
        on = sampler is not None and distill_policy.on_policy(self.seed, self.step, self.lmbda)
        started = time.perf_counter()
        if sampler is not None and on:
            acc = self.accelerator
            drawn = micro_batches  # sampled a micro-batch at a time (an out-of-memory redo halves it), agreed on
            micro_batches = self.alone(lambda: [
                sampler.batch(model, b, [distill_policy.sample_seed(self.seed, self.step, row) for row in
                                         distill_policy.row_numbers(acc.process_index, acc.num_processes, i,
                                                                    len(b["input_ids"]))])
                for i, b in enumerate(drawn)])
        self.step_sums[0] += float(on)
        self.step_sums[1] += time.perf_counter() - started
        self.step_sums[-1] += 1
        return micro_batches

    # -------------------------------------------------------------- the loss

    def _teacher_scores(self, batch: dict, inputs: dict, train: bool) -> tuple:
        """The teacher's view of the micro-batch: (logits,) or, under distill.top_k, (ids, log-probs)."""
        started = time.perf_counter()
        scores: tuple[torch.Tensor, ...]
        if self.cache is not None:
            scores = self.cache.lookup(batch)
        else:
            assert self.teacher is not None, "a distillation objective has its teacher or its cache"
            with torch.no_grad(), self.accelerator.autocast():  # not prepared by the Accelerator: the student's autocast
                logits = self.teacher(**inputs, use_cache=False).logits
            scores = distill_loss.top_k(logits, self.top_k) if self.top_k else (logits,)
        if train:  # the seconds a training step spends on the teacher (metrics.jsonl's timing/teacher_s)
            self.step_sums[2] += time.perf_counter() - started
        return scores

    def _scores(self, model: Any, batch: dict, train: bool) -> tuple[torch.Tensor, ...]:
        """(divergence sum, cross-entropy sum, top-1 agreements, loss tokens) of the micro-batch."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        student = model(**inputs, use_cache=False).logits
        scores = self._teacher_scores(batch, inputs, train)
        if scores[0].shape[:2] != student.shape[:2] or (len(scores) == 1 and scores[0].shape != student.shape):
            # fit_problems refuses this before launch; a hand-built config too
            raise UserError(Problem(teacher_files.KEY, f"the teacher's logits are {tuple(scores[0].shape)} and the "
                                    f"student's {tuple(student.shape)}", fix="a teacher with the student's tokenizer"))
        labels = step_loss.shifted_labels(batch["labels"])  # position i predicts token i + 1 (TRL's shift)
        mask = labels != step_loss.IGNORE
        if len(scores) == 1:
            per_token = distill_loss.per_token(student, scores[0], self.beta, self.temperature)
            teacher_top1 = scores[0].argmax(-1)
        else:
            per_token = distill_loss.per_token_top_k(student, scores[0], scores[1], self.beta, self.temperature)
            teacher_top1 = scores[0][..., 0]
        divergence = per_token[mask].sum()
        # With alpha 0 the cross entropy is only watched: kept out of the graph.
        watched = student if (train and self.alpha) else student.detach()
        cross_entropy = step_loss.summed_cross_entropy(watched, batch["labels"])
        agree = ((student.detach().argmax(-1) == teacher_top1) & mask).sum()
        return divergence, cross_entropy, agree, mask.sum()

    def sums(self, model: Any, batch: dict) -> torch.Tensor:
        divergence, cross_entropy, agree, tokens = self._scores(model, batch, train=True)
        with torch.no_grad():
            self.sums_of_metrics += torch.stack([divergence.detach().double(), cross_entropy.detach().double(),
                                                 agree.double(), tokens.double()])
        loss = (1 - self.alpha) * divergence if self.alpha < 1 else torch.zeros_like(divergence)
        if self.alpha:
            loss = loss + self.alpha * cross_entropy
        return loss.reshape(1)

    def evaluate(self, model: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        """The held-out cross entropy as `eval_loss` (what plain SFT reports, so the two compare), and
        the divergence and agreement over the same tokens, normalised over the whole subset."""
        totals = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=self.accelerator.device)
        model.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    scores = self._scores(model, without_repeats(loader, batch), train=False)
                    totals += torch.stack([v.double() for v in scores])
        finally:
            model.train()
        divergence, cross_entropy, agree, tokens = self.accelerator.reduce(totals, "sum").tolist()
        tokens = max(tokens, 1.0)
        return {"eval_loss": cross_entropy / tokens, "eval_perplexity": math.exp(min(cross_entropy / tokens, 50.0)),
                "eval_distill/loss": divergence / tokens, "eval_distill/top1_agreement": agree / tokens}

    def restore(self, pending: Optional[list]) -> None:
        """A resumed run's interval since its last log point (summed over ranks: kept on one), and the
        steps it had prepared (the on-policy coin and seeds go on from there)."""
        if pending is None:
            return
        n = len(self.sums_of_metrics)
        if self.accelerator.is_main_process:
            self.sums_of_metrics += torch.tensor(pending[:n], dtype=torch.float64, device=self.accelerator.device)
        if len(pending) == n + len(self.step_sums) + 1:  # a checkpoint written before these were kept has none
            self.step_sums, self.step = list(pending[n:-1]), int(pending[-1])

    def pending(self) -> list[float]:
        """The sums since the last read, over every rank, without resetting (what a checkpoint keeps),
        then the step sums and the steps prepared (the same on every rank)."""
        return self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist() + self.step_sums + [self.step]

    def snapshot(self) -> tuple:
        return self.sums_of_metrics.clone(), list(self.step_sums), self.step

    def rewind(self, snapshot: tuple) -> None:
        """As before the step: a redo prepares the same step again (the same coin, the same samples)."""
        self.sums_of_metrics.copy_(snapshot[0])
        self.step_sums, self.step = list(snapshot[1]), snapshot[2]

    def read(self) -> dict[str, float]:
        """The metrics per loss token since the last read, on every rank (a sync: the log point); with
        lmbda > 0 the share of on-policy steps, and the seconds per step of generation and the teacher."""
        *sums, tokens = self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist()
        self.sums_of_metrics.zero_()
        record = {name: value / max(tokens, 1.0) for name, value in zip(METRICS, sums)}
        steps = self.step_sums[-1]
        if steps:
            record.update({name: value / steps for name, value in zip(STEP_METRICS, self.step_sums)})
            if not self.lmbda:  # off-policy: no share to tell, nothing generated
                record.pop("distill_on_policy")
                record.pop("timing/generation_s")
        self.step_sums = [0.0] * len(self.step_sums)
        return record


def cache_entry(cfg: RunConfig, tokenizer: Any, datasets: list) -> tuple[Any, list]:
    """(the teacher cache's directory for this run's keys, the samples in order) (data/teacher_cache.py)."""
    from pathlib import Path

    from overdrive.data.tokens import tokenizer_hash

    teacher = cfg.distill.teacher
    assert teacher is not None, "a distillation run names its teacher (distill.teacher)"
    rows = list(teacher_cache.dataset_rows(datasets))
    path = teacher_cache.entry(Path(cfg.data.cache_dir), teacher, tokenizer_hash(tokenizer),
                               cfg.data.max_length, cfg.distill.top_k, [teacher_cache.digest_of(r) for r in rows])
    return path, rows


def objective(cfg: RunConfig, accelerator: Any, tokenizer: Any, tokens: Any,
              say: Any = None) -> DistillObjective:
    """The objective on this rank's device: the teacher loaded, or under distill.top_k with lmbda 0 its
    cache read when `overdrive distill-cache` wrote one for these keys (the teacher never loaded)."""
    d, say = cfg.distill, say or (lambda _: None)
    assert d.teacher is not None, "a distillation run names its teacher (distill.teacher)"
    cache = None
    if d.top_k and not d.lmbda:
        path, _ = cache_entry(cfg, tokenizer, [tokens.train, tokens.validation])
        if teacher_cache.complete(path):
            cache = teacher_cache.TeacherCache(path)
            now, then = teacher_cache.teacher_fingerprint(d.teacher), cache.meta.get("teacher_files")
            if now is not None and then is not None and now != then:
                say(f"the teacher's files changed since its top-k cache was written ({path}): the teacher scores live")
                cache = None
        if cache is not None:
            say(f"reading the teacher's top-{d.top_k} from its cache ({path}; the teacher is not loaded)")
    if cache is None:
        say(f"loading the teacher ({d.teacher})")
    teacher = None
    if cache is None:  # loaded where the strategy places it from (the host, when it is sharded), then placed
        teacher = frozen.place(load_teacher(cfg, frozen.load_device(cfg, accelerator.device)), cfg, accelerator)
        held, total = frozen.held_here(teacher)
        if held < total:
            say(f"the teacher sharded as the student is: {held:,} of its {total:,} parameters on each rank")
    sampler = None
    if d.lmbda:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        sampler = distill_policy.Sampler(accelerator, pad, tokenizer.eos_token_id, d.temperature, d.max_new_tokens,
                                         cfg.data.max_length, chat=cfg.data.format == "chat",
                                         synced=not registry.of(cfg).holds_whole_model(cfg))
    return DistillObjective(cfg, accelerator, teacher, cache, sampler)
