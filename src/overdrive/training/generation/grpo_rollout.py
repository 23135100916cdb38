"""A tool-calling rollout (`rl.tools`): GRPO's generation phase in several turns, as TRL 1.16's
`GRPOTrainer._tool_call_loop` runs it.

Each completion is read back as a message (training/tools.parse); while its last turn calls tools
(and `rl.max_tool_calling_iterations` allows), the tools run, their results become tool messages,
the template's tokens for them are appended after the policy's (no re-rendering, so what the policy
saw is what the loss sees), and the policy generates its next turn from there. The completion is
everything after the prompt; `tool_mask` is 0 at the tools' tokens, which are context and never in
the loss nor counted as the policy's completion tokens. `rl.max_completion_length` bounds the whole
completion, tools' tokens included: results that would pass it are dropped and the completion ends
as it was (TRL's rule).

A sharded policy (ZeRO-3, FSDP2) over several processes gathers its weights in every forward, so every
rank takes every forward of every turn (`synced`): the ranks agree before each turn whether any of them
still has a completion to continue, and a rank with none keeps the others company (its generate call
forwards a stand-in input and draws nothing) until the slowest rank's last turn.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from overdrive.training.generation import tools as tools_mod


@dataclass
class Rollout:
    completion_ids: list[list[int]]
    tool_mask: list[list[int]]  # 1: the policy's token, 0: a tool's result
    messages: list[list[dict]]  # each completion's turns: assistant, tool(s), assistant, ...
    calls: int = 0
    failures: int = 0
    tool_seconds: float = 0.0
    turns: list[int] = field(default_factory=list)  # the policy's turns per completion
    prompts: list = field(default_factory=list)  # each completion's prompt, as the policy saw it (rl.environment)
    prompt_ids: list[list[int]] = field(default_factory=list)
    sampler_logps: list[list[float]] = field(default_factory=list)  # rl.use_vllm: vLLM's log-prob of each token


def run(generate: Callable[[list[list[int]], int, list[tuple[int, int]]], list[list[int]]], tokenizer: Any,
        tools: Sequence["tools_mod.Tool"], prompt_ids: Sequence[list[int]], first: list[list[int]],
        max_completion_length: int, max_iterations: Optional[int], timeout_s: float,
        max_model_length: Optional[int] = None,
        toolsets: Optional[Sequence[Sequence["tools_mod.Tool"]]] = None,
        calling: Optional[Callable[[int, int], contextlib.AbstractContextManager]] = None,
        synced: Optional[Callable[[bool], bool]] = None) -> Rollout:
    """The rollout of completions `first` (generated from `prompt_ids`, one prompt per completion);
    `generate(inputs, max_new_tokens, turns)` continues each input by one turn of the policy (cut after its
    end-of-sequence token), all pending completions in one call; `turns` says whose each input is:
    (completion, its turn: 1 for the first after the prompt's), so a completion's draws are its own.
    `toolsets`: each completion's own tools (rl.environment: its instance's methods beside rl.tools),
    where they differ; `tools` then lists their schemas for the parser. `calling(completion, turn)`:
    the context its tool calls run in (a random stream of its own). `synced(busy)`: whether any rank is
    busy (every rank asks before each turn): the ranks then call `generate` the same number of times, as a
    sharded policy's forwards need; `generate` is then synced too, forwarding until every rank is done."""
    by_name = [{t.name: t for t in (toolsets[i] if toolsets is not None else tools)} for i in range(len(first))]
    completion_ids = [list(c) for c in first]
    out = Rollout(completion_ids, [[1] * len(c) for c in first],
                  [[tools_mod.parse(tokenizer, c, list(p), tools)] for c, p in zip(first, prompt_ids)],
                  turns=[1] * len(first))
    pending = [i for i, m in enumerate(out.messages) if m[-1].get("tool_calls")]
    iteration = 0
    while max_iterations is None or iteration < max_iterations:
        if synced is None and not pending:
            break
        inputs, kept = [], []
        for i in pending:
            prompt = list(prompt_ids[i])
            started = time.perf_counter()
            with calling(i, iteration + 1) if calling is not None else contextlib.nullcontext():
                answers = [tools_mod.call(by_name[i], c, timeout_s) for c in out.messages[i][-1]["tool_calls"]]
            out.tool_seconds += time.perf_counter() - started
            out.calls += len(answers)
            out.failures += sum(failed for _, _, failed in answers)
            # TRL's: a list of content blocks passes as it is, anything else as its text
            results = [{"role": "tool", "name": name, "content": r if isinstance(r, list) else str(r)}
                       for name, r, _ in answers]
            ids = prompt + completion_ids[i] + tools_mod.suffix_ids(tokenizer, results)
            too_long = len(ids) - len(prompt) > max_completion_length or (
                max_model_length is not None and len(ids) >= max_model_length)
            if too_long:  # the results would not fit: the completion ends as it is, without them
                continue
            out.messages[i] += results
            inputs.append(ids)
            kept.append(i)
        if not (kept if synced is None else synced(bool(kept))):  # synced: every rank turns, or none does
            break
        rooms = [max_completion_length - (len(ids) - len(prompt_ids[i])) for ids, i in zip(inputs, kept)]
        turns = [(i, iteration + 1) for i in kept]
        if not kept:  # another rank continues: a stand-in input keeps its forwards company, its draw dropped
            generate([list(prompt_ids[0])], 1, [(0, iteration + 1)])
            continued = []
        elif synced is not None or max(rooms) > 0:  # a synced call is taken even with no room (cut below)
            continued = generate(inputs, max(max(rooms), 1), turns)
        else:
            continued = [[] for _ in inputs]
        pending = []
        for ids, i, new, room in zip(inputs, kept, continued, rooms):
            new = list(new)[:max(room, 0)]
            tool_length = len(ids) - len(prompt_ids[i]) - len(completion_ids[i])
            out.tool_mask[i] += [0] * tool_length + [1] * len(new)
            completion_ids[i] = ids[len(prompt_ids[i]):] + new
            if new:
                message = tools_mod.parse(tokenizer, new, ids, tools)
                out.messages[i].append(message)
                out.turns[i] += 1
                if message.get("tool_calls"):
                    pending.append(i)
        iteration += 1
    return out
