"""GRPO's generation through vLLM (`rl.use_vllm`), on CUDA GPUs: TRL 1.16's VLLMGeneration
(trl/generation/vllm_generation.py) starts the engine and pushes the weights, this module draws.

    colocate   a `vllm.LLM` in every training process (TRL's arguments: gpu_memory_utilization,
               tensor_parallel_size, max_model_len, enable_sleep_mode; the `external_launcher`
               executor, `logprobs_mode=processed_logprobs` so the log-probs are those of the
               temperature-scaled, filtered distribution the tokens were drawn from). Each completion
               is its own request with `SamplingParams(seed=...)`: completion j of group n draws
               from the same seed as overdrive's own sampler gives it, so what it draws does not
               depend on the batch it is in. With sleep mode the engine sleeps (level 2: weights and
               KV cache freed) between generations; it wakes for the weights before they are pushed
               and for the KV cache before it generates, as TRL does.
    server     a `trl vllm-serve` server, through TRL's VLLMClient (rl.vllm_server_base_url, or
               rl.vllm_server_host and rl.vllm_server_port): the main process sends one request per
               group (`n` = rl.num_generations, `seed` = the group's seed) and hands each rank its
               completions. The server's draws are a function of that seed, its own n and the
               weights: not the per-completion seeds of colocate (vLLM derives the n from one).

`sync(model)` pushes the policy's weights before every generation (`prepare` of a new step, after
the optimizer update; TRL pushes when global_step moved, which with one generation a step is each
step too): under LoRA the adapter merged into the base, named as the base's (TRL's
`_iter_named_params`: merge_adapter, base_layer names, unmerge); under ZeRO-3 or FSDP gathered a
parameter (or, with LoRA, the model) at a time. Every rank calls it: gathering is collective.

`sample(...)` returns each completion's token ids and the sampler's log-prob of each token (NaN
where vLLM gave none): TRL's importance-sampling correction compares them with the trainer's
(training/objectives/grpo_loss.py `vllm_importance_ratio`).

vllm is imported only here, inside functions: overdrive installs and runs without it (the install
extra `overdrive[vllm]`); resolving/validate_rl.py and strategies/cpu.py refuse rl.use_vllm by key
where it cannot run. Not run on this project's CPU machines: untested there (docs/rl.md).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from overdrive.config.schema import RunConfig


def installed() -> bool:
    """Whether the vllm package can be imported here (without importing it: it initialises CUDA)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMSampler:
    """One vLLM engine (colocate) or a client of a server, for one run's GRPO generation."""

    def __init__(self, cfg: RunConfig, accelerator: Any, model: Any, tokenizer: Any, completions_per_rank: int):
        from trl.generation.vllm_generation import VLLMGeneration

        rl = cfg.rl
        self.rl, self.accelerator = rl, accelerator
        # The module itself (DDP's wrapper would prefix every name with `module.`); TRL hands it the
        # model before accelerate.prepare, which is this module under ZeRO-3 and FSDP2 too.
        self.model = accelerator.unwrap_model(model)
        self.engine = VLLMGeneration(
            model=self.model, accelerator=accelerator, processing_class=tokenizer, mode=rl.vllm_mode,
            server_base_url=rl.vllm_server_base_url, server_host=rl.vllm_server_host,
            server_port=rl.vllm_server_port, server_timeout=rl.vllm_server_timeout, group_port=rl.vllm_group_port,
            tensor_parallel_size=rl.vllm_tensor_parallel_size,
            gpu_memory_utilization=rl.vllm_gpu_memory_utilization, max_model_length=rl.vllm_max_model_length,
            # TRL's: a rank's completions of one generation, times the tensor-parallel group that shares them
            max_num_seqs=completions_per_rank * rl.vllm_tensor_parallel_size,
            enable_sleep_mode=rl.vllm_enable_sleep_mode, trust_remote_code=cfg.model.trust_remote_code,
            temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
            max_completion_length=rl.max_completion_length, logprobs=0)

    def sync(self) -> None:
        """The policy's current weights into the engine (or the server); every rank calls it."""
        self.engine.sync_weights()

    def sample(self, prompt_ids: list[list[int]], seeds: list[int], group_seeds: list[int],
               num_generations: int) -> tuple[list[list[int]], list[list[float]]]:
        """(completion ids, the sampler's per-token log-probs) of this rank's completions: `prompt_ids` and
        `seeds` one per completion, groups of `num_generations` consecutive; `group_seeds` one per group."""
        if self.rl.vllm_mode == "server":
            return self._from_server(prompt_ids, group_seeds, num_generations)
        return self._colocated(prompt_ids, seeds)

    def _sampling_params(self, seed: int) -> Any:
        from vllm import SamplingParams

        rl = self.rl
        return SamplingParams(n=1, temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                              max_tokens=rl.max_completion_length, logprobs=0, seed=seed)

    def _colocated(self, prompt_ids: list[list[int]], seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """TRL's colocate branch of VLLMGeneration.generate with one SamplingParams per completion."""
        import torch
        from trl.generation.vllm_generation import extract_logprobs

        engine, tp = self.engine, self.rl.vllm_tensor_parallel_size
        if engine.enable_sleep_mode and engine._llm_weights_sleeping:  # level 2 dropped them: pushed again (TRL's)
            engine.sync_weights()
        requests = list(zip(prompt_ids, seeds))
        if tp > 1:  # every rank of a tensor-parallel group feeds the engine the group's requests (TRL's)
            gathered: list[Any] = [None] * tp
            torch.distributed.all_gather_object(gathered, requests, group=engine.tp_group)
            requests = [r for part in gathered for r in part]
        if engine.enable_sleep_mode:
            engine.llm.wake_up(tags=["kv_cache"])
        if tp > 1 and _is_peft(self.model):  # TRL's barrier before vLLM's collectives (trl#3671)
            torch.distributed.barrier(device_ids=[self.accelerator.local_process_index])
        outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                                      sampling_params=[self._sampling_params(seed) for _, seed in requests],
                                      use_tqdm=False)
        completion_ids = [list(o.token_ids) for out in outputs for o in out.outputs]
        logprobs, _ = extract_logprobs(outputs)
        if tp > 1:  # this rank's share of the group's
            start = torch.distributed.get_rank(group=engine.tp_group) * len(prompt_ids)
            completion_ids = completion_ids[start:start + len(prompt_ids)]
            logprobs = logprobs[start:start + len(prompt_ids)] if logprobs is not None else None
        if engine.enable_sleep_mode:
            engine.llm.sleep(level=2)
            engine._llm_weights_sleeping = True
        return completion_ids, _first_logprobs(logprobs, completion_ids)

    def _from_server(self, prompt_ids: list[list[int]], group_seeds: list[int],
                     num_generations: int) -> tuple[list[list[int]], list[list[float]]]:
        """TRL's server branch: the ranks' groups gathered on the main process, sent, the completions broadcast."""
        from accelerate.utils import broadcast_object_list, gather_object

        rl, acc = self.rl, self.accelerator
        groups = gather_object(list(zip(prompt_ids[::num_generations], group_seeds)))
        payload: list[Any] = [None]
        if acc.is_main_process:
            completion_ids: list[list[int]] = []
            logprobs: list[Any] = []
            for ids, seed in groups:  # a request a group: its seed is the group's, whatever else is asked
                out = self.engine.vllm_client.generate(
                    prompts=[ids], n=num_generations, temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                    max_tokens=rl.max_completion_length, logprobs=0, generation_kwargs={"seed": seed})
                completion_ids += out["completion_ids"]
                logprobs += out["logprobs"] if out["logprobs"] is not None else [None] * num_generations
            payload = [(completion_ids, logprobs)]
        broadcast_object_list(payload, from_process=0)
        everyone, every_logprob = payload[0]
        mine = slice(acc.process_index * len(prompt_ids), (acc.process_index + 1) * len(prompt_ids))
        return everyone[mine], _first_logprobs(every_logprob[mine], everyone[mine])


def _first_logprobs(logprobs: Any, completion_ids: list[list[int]]) -> list[list[float]]:
    """The sampled token's log-prob of each position (vLLM's first, with logprobs=0), NaN where there is none."""
    if logprobs is None:
        logprobs = [None] * len(completion_ids)
    return [[math.nan] * len(ids) if seq is None else
            [math.nan if (not lp or lp[0] is None) else float(lp[0]) for lp in seq]
            for seq, ids in zip(logprobs, completion_ids)]


def _is_peft(model: Any) -> bool:
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(model))
