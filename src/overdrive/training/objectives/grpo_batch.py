"""GRPO's micro-batches of completions, in TRL's layout (prompts left-padded, completions
right-padded), with what the loss reads beside them: advantages, the generation-time and the
reference's log-probs, rl.use_vllm's importance-sampling ratio, and under rl.tools the mask of the tools' tokens (0: context, not trained).
training/objectives/grpo.py builds them; `recut` cuts the same completions at another micro-batch size
(training.oom_retry's redo, rl.num_iterations' cached batches).
"""

from __future__ import annotations

from typing import Optional

import torch


def _pad(rows: list[list[int]], value: int, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, span] = torch.tensor(row, dtype=torch.long)
            mask[i, span] = 1
    return ids.to(device), mask.to(device)


def _pad_float(rows: list[torch.Tensor], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row.to(device)
    return out


def completion_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], advantages: torch.Tensor,
                     pad_id: int, device, old: Optional[list] = None, ref: Optional[list] = None,
                     tool_mask: Optional[list[list[int]]] = None, is_ratio: Optional[list] = None) -> dict:
    """A micro-batch of completions as the loss reads it (TRL's layout: prompts left-padded,
    completions right-padded) plus `input_ids`/`labels` for the loop's token counts. `tool_mask`
    (rl.tools): 0 at the tokens of a tool's result, which are context and never trained (TRL's)."""
    p_ids, p_mask = _pad(prompt_ids, pad_id, True, device)
    c_ids, c_mask = _pad(completion_ids, pad_id, False, device)
    input_ids = torch.cat([p_ids, c_ids], dim=1)
    trained = c_mask
    if tool_mask is not None:
        trained = c_mask * _pad_float([torch.tensor(m, dtype=torch.float32) for m in tool_mask], c_ids.shape[1],
                                      device).long()
    labels = torch.cat([torch.full_like(p_ids, -100), c_ids.masked_fill(trained == 0, -100)], dim=1)
    batch = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask,
             "advantages": advantages.to(device), "input_ids": input_ids, "labels": labels,
             "attention_mask": torch.cat([p_mask, c_mask], dim=1)}
    if tool_mask is not None:
        batch["tool_mask"] = trained
    if old is not None:
        batch["old_per_token_logps"] = _pad_float(old, c_ids.shape[1], device)
    if ref is not None:
        batch["ref_per_token_logps"] = _pad_float(ref, c_ids.shape[1], device)
    if is_ratio is not None:  # rl.use_vllm's importance-sampling correction, per token
        batch["importance_sampling_ratio"] = _pad_float(is_ratio, c_ids.shape[1], device)
    return batch


def recut(batches: list[dict], micro: int, pad: int) -> list[dict]:
    """The same completions, in order, `micro` to a micro-batch (their padding trimmed and redone)."""
    prompts, completions, advantages, old, ref, tools, ratios, rows = [], [], [], [], [], [], [], []
    for b in batches:
        for i in range(b["completion_ids"].shape[0]):
            rows.append(int(b["prompt_row"][i]) if "prompt_row" in b else None)
            prompts.append(b["prompt_ids"][i][b["prompt_mask"][i] == 1].tolist())
            kept = b["completion_mask"][i] == 1
            completions.append(b["completion_ids"][i][kept].tolist())
            tools.append(b["tool_mask"][i][kept].tolist() if "tool_mask" in b else None)
            advantages.append(b["advantages"][i])
            old.append(b["old_per_token_logps"][i][kept] if "old_per_token_logps" in b else None)
            ref.append(b["ref_per_token_logps"][i][kept] if "ref_per_token_logps" in b else None)
            ratios.append(b["importance_sampling_ratio"][i][kept] if "importance_sampling_ratio" in b else None)
    device = batches[0]["completion_ids"].device
    out = []
    for start in range(0, len(completions), micro):
        span = slice(start, start + micro)
        batch = completion_batch(prompts[span], completions[span], torch.stack(advantages[span]), pad, device,
                                 old=old[span] if old[0] is not None else None,
                                 ref=ref[span] if ref[0] is not None else None,
                                 tool_mask=tools[span] if tools[0] is not None else None,
                                 is_ratio=ratios[span] if ratios[0] is not None else None)
        if rows[0] is not None:  # a vision-language policy's prompt rows: their images are added again after
            batch["prompt_row"] = torch.tensor(rows[span], device=device)
        out.append(batch)
    return out


def trained_mask(batch: dict) -> torch.Tensor:
    """The completion tokens in the loss: the policy's own, not a tool's result (TRL's completion_mask x tool_mask)."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask
