"""GRPO as an objective of the loop's step (`rl.method: grpo`), with a generation phase.

    prepare(model, micro_batches)   before the step's units are counted: the step's slots
                                    (data/prompts.py) become completions. Each group (one prompt,
                                    `rl.num_generations` completions) is sampled by the policy with
                                    a seed of its own (training.seed and the group's number), so the
                                    same global batch gets the same completions on 1 process or N and
                                    after a resume; rewarded (training/objectives/rewards.py); the rewards of
                                    the whole global batch gathered for the advantages; the reference
                                    (and, with rl.num_iterations > 1, the generation-time) log-probs
                                    taken; and the completions cut into micro-batches again.
    counts(batch)                   completions or completion tokens, by the loss type
    sums(model, batch)              the loss type's sum over this micro-batch's units
    read() / pending() / restore()  TRL's metrics since the last log point

The arithmetic is TRL's (grpo_loss.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from overdrive.config.schema import RunConfig
from overdrive.data import vision_prompts
from overdrive.data.prompts import PromptSet
from overdrive.training.generation import sampling
from overdrive.training.objectives import grpo_loss, rewards as rewards_mod
# The micro-batch layout, here by name as before (training/objectives/grpo_batch.py holds it)
from overdrive.training.generation import environments as environments_mod, grpo_rollout, tools as tools_mod
from overdrive.training.objectives.grpo_batch import _pad, completion_batch, recut, trained_mask  # noqa: F401
from overdrive.training.objectives.objective import Objective

if TYPE_CHECKING:  # rl.use_vllm's engine (vllm itself is imported lazily there)
    from overdrive.training.generation import vllm_sampling

# Token-level sums of the loss's forward (over every rank at a read): TRL's global masked means.
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# Step-level values from the gathered batch (the same on every rank): their mean over the steps read.
# With rl.tools: TRL's tool statistics (calls per completion, failures per call), and ours.
TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency", "tools/turns_mean", "timing/tools_s")
STEP_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "timing/generation_s", "timing/scoring_s", "timing/reference_s")


def enabled(cfg: RunConfig) -> bool:
    return cfg.rl.method != "none"


def group_seed(seed: int, group: int) -> int:
    """The sampling seed of one group: a function of the run's seed and the group's number alone."""
    return sampling.mixed_seed(seed, group)


def completion_logps(model: Any, batch: dict, temperature: float,
                     kernel: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-probs, entropies) [B, C] of a batch's completions under `model`: from the
    completions' logits, or under training.loss_kernel=chunked a slice at a time without them."""
    width = batch["completion_ids"].shape[1]
    images = {k: batch[k] for k in ("mm_token_type_ids", *vision_prompts.IMAGE_INPUTS) if k in batch}  # a VLM's prompts
    if kernel == "chunked":
        from overdrive.training.step import loss_kernels

        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return loss_kernels.completion_logps(model, inputs, batch["completion_ids"], temperature)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                logits_to_keep=width + 1, **images)
    return grpo_loss.token_scores(out.logits[:, :-1], batch["completion_ids"], temperature)


class GRPOObjective(Objective):
    """GRPO as the composed step's objective (training/objectives/objective.py): `prepare` generates and
    scores the step's completions, `counts` / `sums` are the loss type's units and summed loss."""

    name = "grpo on prompts"  # what the run's first line says it trains
    # The loss sits near zero and goes negative (advantages are centred in each group): no scale
    # for "F x the mean"; a bad batch shows in the gradient it pulls with (training/guards/loss_spikes.py).
    spike_measure = "grad_norm"

    def __init__(self, cfg: RunConfig, accelerator, tokenizer, prompts: PromptSet,
                 reference: Optional[Callable[[Any], contextlib.AbstractContextManager]] = None,
                 sharded: bool = False, kernel: str = "full", tools: Sequence["tools_mod.Tool"] = (),
                 environment: Optional["environments_mod.Environment"] = None):
        self.rl, self.seed, self.micro = cfg.rl, cfg.training.seed, cfg.training.micro_batch_size
        self.kernel = kernel  # training.loss_kernel as it runs: full or chunked (the log-probs without the logits)
        self.accelerator, self.tokenizer, self.prompts = accelerator, tokenizer, prompts
        self.rewards = rewards_mod.build(cfg.rl.reward_funcs)
        self.environment = environment  # rl.environment, probed: one instance per completion (environments.py)
        self.pool = environments_mod.Pool(environment) if environment is not None else None
        if environment is not None and environment.has_reward:  # TRL's: one more reward, weight 1, the class's name
            self.rewards.append(rewards_mod.Reward(environment.name, 1.0, environments_mod.reward_function(environment),
                                                   environments_mod.KEY))
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        self.reference = reference  # model -> the context in which it is the reference (beta > 0)
        self.sharded = sharded  # every rank takes every forward of generate (ZeRO-3, FSDP2)
        self.vision = isinstance(prompts, vision_prompts.VisionPromptSet)  # image inputs go with the forwards
        self.eps_low, self.eps_high = cfg.rl.epsilon, cfg.rl.epsilon_high if cfg.rl.epsilon_high else cfg.rl.epsilon
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = {i for i in [tokenizer.eos_token_id, self.pad_id] if i is not None}
        self.tools = list(tools)  # rl.tools, built (training/generation/tools.py): generation runs in turns (grpo_rollout.py)
        # Every tool's schema the parser reads calls by: rl.tools' and the environment's methods'
        self.schemas = self.tools + (environments_mod.tools_of(environment.probe, environment) if environment else [])
        self.turns = bool(self.tools) or environment is not None  # a multi-turn rollout
        self.names = STEP_METRICS + tuple(f"rewards/{r.name}/{s}" for r in self.rewards for s in ("mean", "std"))
        if self.turns:  # added after the rewards' so a run without tools keeps its pending metrics' layout
            self.names += TOOL_METRICS
        device = accelerator.device
        # TOKEN_METRICS' sums, the trained tokens, and what the clip flags were counted over.
        self.token_sums = torch.zeros(len(TOKEN_METRICS) + 2, dtype=torch.float64, device=device)
        self.step_sums = [0.0] * (len(self.names) + 1)  # the last counts steps
        self.cached: Optional[tuple[tuple, list]] = None  # (groups, micro-batches) under num_iterations > 1
        self.samples_path: Optional[Path] = None  # completions.jsonl: one group of each generation, for a look
        # rl.use_vllm: model -> the engine (training/generation/vllm_sampling.py), started at the first generation
        self.vllm_factory: Optional[Callable[[Any], "vllm_sampling.VLLMSampler"]] = None
        self.vllm: Optional["vllm_sampling.VLLMSampler"] = None
        # Completions per generate call: all of a rank's step in one, until sampling ran out of memory
        self.sampling_rows: Optional[int] = None

    # -------------------------------------------------------------- generation

    def prepare(self, model, micro_batches: list[dict]) -> list[dict]:
        slots = torch.cat([b["slot"] for b in micro_batches]).tolist()
        groups = torch.cat([b["group"] for b in micro_batches]).tolist()
        prompt_rows = torch.cat([b["prompt_index"] for b in micro_batches]).tolist()
        order = sorted(range(len(slots)), key=lambda i: slots[i])  # the logical order: groups consecutive
        groups, prompt_rows = [groups[i] for i in order], [prompt_rows[i] for i in order]
        key = tuple(groups)
        if self.cached is not None and self.cached[0] == key:  # the next update on the same completions
            return self.cached[1]
        g = self.rl.num_generations
        firsts = list(range(0, len(groups), g))
        if any(groups[i:i + g] != [groups[i]] * g for i in firsts):
            raise RuntimeError("a group of completions is split across ranks or steps: the slot layout is wrong")
        started = time.perf_counter()
        instances = self.pool.take(len(groups)) if self.pool is not None else []
        try:  # a rank samples alone: an out-of-memory error here is agreed on before the gathers below
            with torch.no_grad():
                rollouts = [self.alone(lambda: self._generate(model, [prompt_rows[f] for f in firsts],
                                                              [groups[f] for f in firsts], instances))]
        except Exception:  # the step is redone (training.oom_retry) or the run ends: the redo samples in halves
            self.sampling_rows = max(1, (self.sampling_rows or len(groups)) // 2)
            raise
        completion_ids = [c for r in rollouts for c in r.completion_ids]
        generated = time.perf_counter()
        rows = [self.prompts.rows[i] for i in prompt_rows]
        prompts = [p for r in rollouts for p in r.prompts]  # as the policy saw them (with reset's text appended)
        prompt_ids = [p for r in rollouts for p in r.prompt_ids]
        if self.turns:  # each completion its turns, as TRL hands them to the rewards
            completions = [m for r in rollouts for m in r.messages]
        else:
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            completions = [[{"role": "assistant", "content": t}] for t in texts] if self.prompts.conversational else texts
        tool_mask = [m for r in rollouts for m in r.tool_mask] if self.turns else None
        columns = rewards_mod.columns_of(rows)
        if instances:  # TRL hands every reward the completions' environments
            columns["environments"] = instances
        local = torch.tensor(rewards_mod.score(self.rewards, prompts, completions, completion_ids, columns,
                                                       prompt_rows),
                             dtype=torch.float32, device=self.accelerator.device).view(len(completions), -1)
        everyone = self.accelerator.gather(local) if self.accelerator.num_processes > 1 else local
        adv = grpo_loss.group_advantages(everyone, self.weights, g, self.rl.scale_rewards,
                                         self.rl.multi_objective_aggregation, self.rl.baseline)
        rank = self.accelerator.process_index
        mine = adv.advantages[rank * len(completions):(rank + 1) * len(completions)]
        scored = time.perf_counter()
        sampled = [lp for r in rollouts for lp in r.sampler_logps] or None  # rl.use_vllm
        batches = self._micro_batches(model, prompt_ids, completion_ids, mine, tool_mask, rows=prompt_rows,
                                      sampler_logps=sampled)
        self._step_metrics(everyone, adv, completion_ids,
                           (generated - started, scored - generated, time.perf_counter() - scored),
                           rollouts if self.turns else None)
        if self.accelerator.is_main_process and self.samples_path is not None:
            self._keep_samples(groups[0], prompts[:g], completions[:g], adv.rewards[:g].tolist())
        self.cached = (key, batches) if self.rl.num_iterations > 1 else None
        return batches

    def _keep_samples(self, group: int, prompts: list, completions: list, rewards: list[float]) -> None:
        """One group of completions appended to completions.jsonl beside metrics.jsonl (the main process)."""
        from overdrive.storage import faults

        # A completion no reward applies to (all None) has a NaN reward: null, as JSON has no NaN.
        lines = "".join(json.dumps({"group": group, "prompt": p, "completion": c,
                                    "reward": r if math.isfinite(r) else None}, default=str, allow_nan=False) + "\n"
                        for p, c, r in zip(prompts, completions, rewards))
        with faults.writing(self.samples_path, "output_dir", what="sampled completions"):
            with open(self.samples_path, "a") as f:
                f.write(lines)

    def _generate(self, model, rows: list[int], groups: list[int],
                  instances: Sequence[Any] = ()) -> "grpo_rollout.Rollout":
        """The completions of groups `groups` (of prompt rows `rows`), each cut after its first end-of-sequence
        token (TRL's), all in one batched call; with rl.tools or rl.environment in turns
        (training/generation/grpo_rollout.py), each turn of every pending completion in one call. Completion j of
        group n draws from a seed of its own, (training.seed, n, j) mixed, a tool turn t from (that, t): what it
        draws does not depend on the batch it is generated in; an environment's reset draws from the group's."""
        acc, rl, g = self.accelerator, self.rl, self.rl.num_generations
        prompts, prompt_ids, seeds = [], [], []
        for k, (row, group) in enumerate(zip(rows, groups)):
            seed = group_seed(self.seed, group)
            said, ids = [self.prompts.prompts[row]] * g, [self.prompts.prompt_ids[row]] * g
            if instances:  # Python's and NumPy's streams (an environment may draw from them) the group's, then restored
                with environments_mod.seeded(seed):
                    said, ids = environments_mod.reset_group(
                        instances[k * g:(k + 1) * g], self.prompts.rows[row], self.prompts.prompts[row],
                        self.prompts.prompt_ids[row], self.tokenizer, [t.schema for t in self.schemas],
                        f"data.source row {row + 1}")
            prompts += said
            prompt_ids += ids
            seeds += [sampling.mixed_seed(seed, j) for j in range(g)]
        if self.vllm_factory is not None:  # rl.use_vllm: one turn of text (validate_rl.py refuses the rest)
            return self._vllm_generate(model, prompts, prompt_ids, seeds, [group_seed(self.seed, n) for n in groups])
        # the training RNG stream is left as it was, and Python's and NumPy's the tools may draw from
        with sampling.seeded(acc, self.seed), environments_mod.streams_kept():
            first = self._sample(model, prompt_ids, rl.max_completion_length, seeds, [r for r in rows for _ in range(g)])
            if not self.turns:
                return grpo_rollout.Rollout(first, [], [], prompts=prompts, prompt_ids=prompt_ids)
            toolsets = [self.tools + environments_mod.tools_of(e, self.environment) for e in instances] or None
            out = grpo_rollout.run(
                lambda inputs, room, turns: self._sample(model, inputs, room,
                                                         [sampling.mixed_seed(seeds[i], t) for i, t in turns]),
                self.tokenizer, self.schemas, prompt_ids, first, rl.max_completion_length,
                rl.max_tool_calling_iterations, rl.tool_timeout_s,
                getattr(acc.unwrap_model(model).config, "max_position_embeddings", None), toolsets=toolsets,
                calling=lambda i, t: environments_mod.reseed(sampling.mixed_seed(seeds[i], t)),
                synced=(lambda busy: sampling.any_rank_busy(busy, acc.device)) if self.sharded and acc.num_processes > 1 else None)
        out.prompts, out.prompt_ids = prompts, prompt_ids
        return out

    def _vllm_generate(self, model, prompts: list, prompt_ids: list[list[int]], seeds: list[int],
                       group_seeds: list[int]) -> "grpo_rollout.Rollout":
        """The completions drawn by vLLM from the weights of now (pushed first: the optimizer has moved them since
        the last generation, or a resume loaded them), each cut after its first end-of-sequence token as the own
        sampler cuts, with vLLM's log-prob of each token kept."""
        if self.vllm is None and self.vllm_factory is not None:
            self.vllm = self.vllm_factory(model)
        assert self.vllm is not None
        self.vllm.sync()
        completion_ids, logps = self.vllm.sample(prompt_ids, seeds, group_seeds, self.rl.num_generations)
        cut = [next((k + 1 for k, t in enumerate(ids) if t in self.eos_ids), len(ids)) for ids in completion_ids]
        return grpo_rollout.Rollout([list(ids[:n]) for ids, n in zip(completion_ids, cut)], [], [], prompts=prompts,
                                    prompt_ids=prompt_ids, sampler_logps=[lp[:n] for lp, n in zip(logps, cut)])

    def _sample(self, model, inputs: list[list[int]], max_new_tokens: int, seeds: list[int],
                rows: Optional[list[int]] = None) -> list[list[int]]:
        """A turn of the policy after each input (training/generation/sampling.py), cut after its end-of-sequence,
        input i drawn from `seeds[i]`; `rows`: the prompts' rows, whose images a vision-language policy sees."""
        rl, out = self.rl, []
        # In batches of sampling_rows once sampling ran out of memory (the draws are each completion's own: the
        # same completions); a sharded policy's ranks never split theirs (they would not turn together)
        size = len(inputs) if self.sharded or not self.sampling_rows else self.sampling_rows
        for start in range(0, len(inputs), max(size, 1)):
            span, part = slice(start, start + size), rows[start:start + size] if rows else None
            out += sampling.sample(model, self.accelerator, inputs[span], max_new_tokens, pad_id=self.pad_id,
                                   eos_id=self.tokenizer.eos_token_id, temperature=rl.temperature, top_p=rl.top_p,
                                   top_k=rl.top_k, synced=self.sharded, seeds=seeds[span],
                                   continuous_batching=rl.use_transformers_continuous_batching,
                                   inputs_for=functools.partial(self._images, part, completion_width=0)
                                   if part and self.vision else None)
        return out

    def _micro_batches(self, model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                       advantages: torch.Tensor, tool_mask: Optional[list[list[int]]] = None,
                       rows: Optional[list[int]] = None,
                       sampler_logps: Optional[list[list[float]]] = None) -> list[dict]:
        """The step's completions, `micro` to a batch, with the reference's (and the old) log-probs; `rows`:
        each completion's prompt row (a vision-language policy's images go with every forward); `sampler_logps`
        (rl.use_vllm): vLLM's, whose ratio to the trainer's weights each token's loss (`importance_sampling_ratio`)."""
        truncated = [not ids or ids[-1] not in self.eos_ids for ids in completion_ids]
        if self.rl.mask_truncated_completions:  # DAPO: a cut completion says nothing about its reward
            completion_ids = [[] if cut else ids for ids, cut in zip(completion_ids, truncated)]
            if tool_mask is not None:
                tool_mask = [[] if cut else m for m, cut in zip(tool_mask, truncated)]
        batches = []
        for start in range(0, len(completion_ids), self.micro):
            span = slice(start, start + self.micro)
            batch = completion_batch(prompt_ids[span], completion_ids[span],
                                     advantages[span], self.pad_id, self.accelerator.device,
                                     tool_mask=tool_mask[span] if tool_mask is not None else None)
            batch.update(self._images(rows[span] if rows is not None else None, batch["prompt_ids"].shape[1],
                                      batch["completion_ids"].shape[1]))
            if self.vision and rows is not None:  # what a recut needs to add the images again (resplit)
                batch["prompt_row"] = torch.tensor(rows[span], device=self.accelerator.device)
            batches.append(batch)
        with torch.no_grad():
            correct = sampler_logps is not None and self.rl.vllm_importance_sampling_correction
            if self.rl.num_iterations > 1 or correct:  # the policy that sampled them, for the ratio of later updates
                for start, batch in zip(range(0, len(completion_ids), self.micro), batches):
                    old = completion_logps(model, batch, self.rl.temperature, self.kernel)[0]
                    if self.rl.num_iterations > 1:
                        batch["old_per_token_logps"] = old
                    if correct and sampler_logps is not None:
                        batch["importance_sampling_ratio"] = grpo_loss.sampler_ratio(
                            old, sampler_logps[start:start + self.micro], trained_mask(batch),
                            self.rl.vllm_importance_sampling_mode, self.rl.vllm_importance_sampling_clip_min,
                            self.rl.vllm_importance_sampling_clip_max)
            if self.rl.beta != 0.0 and self.reference is not None:
                # Entered once for the step (switching a LoRA adapter off and on costs a forward's time on a CPU)
                with self.reference(model) as reference_model:
                    for batch in batches:
                        batch["ref_per_token_logps"] = completion_logps(reference_model, batch, self.rl.temperature,
                                                                        self.kernel)[0]
        return batches

    def _images(self, rows: Optional[list[int]], prompt_width: int, completion_width: int) -> dict:
        """A vision-language policy's image inputs for these prompt rows (data/vision_prompts.py); none for text."""
        if rows is None or not isinstance(self.prompts, vision_prompts.VisionPromptSet):
            return {}
        return vision_prompts.image_inputs(self.prompts, rows, prompt_width, completion_width, self.accelerator.device)

    def _step_metrics(self, rewards_per_func: torch.Tensor, adv: "grpo_loss.Advantages",
                      completion_ids: list[list[int]], seconds: tuple[float, float, float],
                      rollouts: Optional[list["grpo_rollout.Rollout"]] = None) -> None:
        acc = self.accelerator
        # The policy's own tokens (TRL's): a tool's result is not its completion
        own = [sum(m) for r in rollouts for m in r.tool_mask] if rollouts else [len(c) for c in completion_ids]
        lengths = torch.tensor(own, dtype=torch.float32, device=acc.device)
        cut = torch.tensor([not c or c[-1] not in self.eos_ids for c in completion_ids], device=acc.device)
        if acc.num_processes > 1:
            lengths, cut = acc.gather(lengths), acc.gather(cut)
        terminated = lengths[~cut] if (~cut).any() else torch.zeros(1, device=acc.device)
        values = [torch.nanmean(adv.rewards).item(), grpo_loss.nanstd(adv.rewards).item(),
                  adv.is_std_zero.float().mean().item(), lengths.mean().item(), lengths.min().item(),
                  lengths.max().item(), cut.float().mean().item(), terminated.mean().item(), *seconds]
        for j in range(len(self.rewards)):
            values += [torch.nanmean(rewards_per_func[:, j]).item(), grpo_loss.nanstd(rewards_per_func[:, j]).item()]
        if rollouts is not None:
            values += self._tool_metrics(rollouts, len(completion_ids))
        self.step_sums = [s + v for s, v in zip(self.step_sums, values + [1.0])]

    def _tool_metrics(self, rollouts: list["grpo_rollout.Rollout"], completions: int) -> list[float]:
        """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (per call; 0 without a
        call), the policy's turns per completion and the seconds in tools, over every rank."""
        acc = self.accelerator
        local = torch.tensor([sum(r.calls for r in rollouts), sum(r.failures for r in rollouts),
                              sum(sum(r.turns) for r in rollouts), completions,
                              sum(r.tool_seconds for r in rollouts)], dtype=torch.float64, device=acc.device)
        calls, failures, turns, count, seconds = (acc.reduce(local, "sum") if acc.num_processes > 1 else local).tolist()
        return [calls / count, failures / calls if calls else 0.0, turns / count, seconds / acc.num_processes]

    # -------------------------------------------------------------- guards

    def corrupt(self, batch: dict, generator: torch.Generator) -> dict:
        """A broken reward: advantages of 50 x a standard normal, whatever the completions said."""
        noise = 50.0 * torch.randn(batch["advantages"].shape, generator=generator)
        return {**batch, "advantages": noise.to(batch["advantages"].device, batch["advantages"].dtype)}

    def snapshot(self) -> tuple:
        return self.token_sums.clone(), list(self.step_sums), self.cached

    def rewind(self, snapshot: tuple) -> None:
        """The metric sums as before the step; completions it generated dropped (the redo generates
        them again from the same weights and seeds, with their metrics), an earlier step's kept."""
        self.token_sums.copy_(snapshot[0])
        self.step_sums = list(snapshot[1])
        self.cached = snapshot[2]

    def resplit(self, micro: int) -> None:
        """The completions cut `micro` to a batch from now on; those kept for rl.num_iterations > 1
        cut again, with the log-probs taken when they were generated (not the weights' since)."""
        self.micro = micro
        if self.cached is not None:
            batches = recut(self.cached[1], micro, self.pad_id)
            for batch in batches:  # a vision-language policy's images, for the prompt rows of the new cut
                if "prompt_row" in batch:
                    batch.update(self._images(batch["prompt_row"].tolist(), batch["prompt_ids"].shape[1],
                                              batch["completion_ids"].shape[1]))
            self.cached = (self.cached[0], batches)

    # -------------------------------------------------------------- the loss

    def counts(self, batch: dict) -> torch.Tensor:
        return grpo_loss.units(self.rl.loss_type, trained_mask(batch))

    def sums(self, model, batch: dict) -> torch.Tensor:
        """The loss type's sum over this micro-batch's units, forward included."""
        logps, entropy = completion_logps(model, batch, self.rl.temperature, self.kernel)
        mask = trained_mask(batch)  # the policy's own tokens: a tool's result is context (rl.tools)
        rl = self.rl
        token = grpo_loss.per_token_loss(logps, batch.get("old_per_token_logps"), batch.get("ref_per_token_logps"),
                                         batch["advantages"], rl.beta, self.eps_low, self.eps_high,
                                         loss_type=rl.loss_type, sequence_level=rl.sequence_level, mask=mask,
                                         sapo_temperatures=(rl.sapo_temperature_pos, rl.sapo_temperature_neg),
                                         importance_ratio=batch.get("importance_sampling_ratio"))
        summed = grpo_loss.reduce(token.loss, mask, rl.loss_type, rl.max_completion_length)
        with torch.no_grad():
            m = mask.double()
            kl = (token.kl.double() * m).sum() if token.kl is not None else m.new_zeros(())
            # The clip flags are per token, or per completion at the sequence level (TRL's means over
            # sequences there): each then counts once, over the completions with a trained token.
            c = m if token.ratio.shape == m.shape else (m.sum(-1, keepdim=True) > 0).double()
            values = [kl, (entropy.double() * m).sum(), (token.low_clipped * c).sum(), (token.high_clipped * c).sum(),
                      ((token.low_clipped | token.high_clipped) * c).sum(), m.sum(), c.sum()]
            self.token_sums += torch.stack(values)
        return summed

    # -------------------------------------------------------------- metrics

    def pending(self) -> list[float]:
        """The sums since the last read (token sums over every rank), without resetting: a checkpoint keeps them."""
        return self.accelerator.reduce(self.token_sums.clone(), "sum").tolist() + list(self.step_sums)

    def restore(self, pending: Optional[list]) -> None:
        if not pending or len(pending) != len(self.token_sums) + len(self.step_sums):
            return
        n = len(self.token_sums)
        if self.accelerator.is_main_process:  # summed over ranks when read: kept on one
            self.token_sums += torch.tensor(pending[:n], dtype=torch.float64, device=self.accelerator.device)
        self.step_sums = list(pending[n:])

    def read(self) -> dict[str, float]:
        totals = self.accelerator.reduce(self.token_sums.clone(), "sum").tolist()
        self.token_sums.zero_()
        tokens, flagged = max(totals[-2], 1.0), max(totals[-1], 1.0)
        record = {name: value / (flagged if name.startswith("clip_ratio") else tokens)
                  for name, value in zip(TOKEN_METRICS, totals)}
        if self.rl.beta == 0.0:
            record.pop("kl")
        if self.rl.loss_type in ("cispo", "sapo"):  # no two-sided clip: TRL logs cispo's own ratio, none for sapo
            clipped = record.pop("clip_ratio/high_mean")
            for name in ("clip_ratio/low_mean", "clip_ratio/region_mean"):
                record.pop(name)
            if self.rl.loss_type == "cispo":
                record["cispo_clip_ratio"] = clipped
        steps = self.step_sums[-1]
        if steps:  # none under rl.num_iterations > 1 when every step read trained on earlier completions
            record.update({name: value / steps for name, value in zip(self.names, self.step_sums)})
        self.step_sums = [0.0] * len(self.step_sums)
        return record

    def evaluate(self, model, loader, accelerator=None) -> dict[str, float]:
        return {}  # no held-out prompts yet: an RL run has no eval_loader
