"""The GRPO family's losses (rl.loss_type gspo, cispo, sapo; rl.importance_sampling_level) against
TRL 1.16's `GRPOTrainer._compute_loss` itself, on the same tensors: TRL's log-prob forward is
replaced by one that returns the very tensor our loss reads, so the loss and its gradient with
respect to every log-prob are compared to 1e-6. A `tool_mask` (tool-result tokens) takes some tokens
out of both losses, as a tool-calling rollout does.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from overdrive.training.objectives import grpo_loss  # noqa: E402

B, C, MAX_LEN = 6, 5, 7


class OneProcess:
    device = torch.device("cpu")
    process_index, num_processes, is_main_process, sync_gradients = 0, 1, True, True

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def autocast(self):
        return contextlib.nullcontext()


def _tensors(seed: int, beta: float):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, C, generator=g) * 3).requires_grad_()
    old = logps.detach() + 0.5 * torch.randn(B, C, generator=g)  # a later iteration: both clips bite
    ref = logps.detach() + 0.3 * torch.randn(B, C, generator=g) if beta else None
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 3:] = 0
    completion_mask[4, 1:] = 0
    tool_mask = torch.ones(B, C, dtype=torch.long)
    tool_mask[0, 1:3] = 0  # a tool's result inside a completion
    tool_mask[2, 2] = 0
    advantages = torch.randn(B, generator=g)
    return logps, old, ref, completion_mask, tool_mask, advantages


def _trl_loss(logps, old, ref, completion_mask, tool_mask, advantages, loss_type, level, beta, eps_high):
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    values = dict(
        model=SimpleNamespace(training=True), accelerator=OneProcess(), top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=level, loss_type=loss_type, beta=beta,
        epsilon_low=0.2, epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                             sapo_temperature_neg=1.05, steps_per_generation=1))
    for name, value in values.items():
        setattr(t, name, value)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps.detach()), None)
    mask = completion_mask * tool_mask
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": completion_mask,
              "tool_mask": tool_mask, "advantages": advantages, "old_per_token_logps": old,
              "num_items_in_batch": mask.sum().float()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return t._compute_loss(t.model, inputs), t._metrics["train"]


def _our_loss(logps, old, ref, completion_mask, tool_mask, advantages, loss_type, level, beta, eps_high):
    mask = completion_mask * tool_mask
    token = grpo_loss.per_token_loss(logps, old, ref, advantages, beta, 0.2, eps_high, loss_type=loss_type,
                                     sequence_level=level == "sequence" or loss_type == "gspo", mask=mask)
    return grpo_loss.reduce(token.loss, mask, loss_type, MAX_LEN) / grpo_loss.units(loss_type, mask), token, mask


CASES = [  # (ours, TRL's loss_type, importance_sampling_level, beta, epsilon_high)
    ("gspo", "grpo", "sequence", 0.0, 0.2), ("gspo", "grpo", "sequence", 0.04, 0.28),
    ("dapo", "dapo", "sequence", 0.0, 0.28), ("cispo", "cispo", "token", 0.0, 5.0),
    ("cispo", "cispo", "token", 0.04, 1.2), ("sapo", "sapo", "token", 0.0, 0.2), ("sapo", "sapo", "token", 0.04, 0.2),
    ("grpo", "grpo", "token", 0.04, 0.2), ("dr_grpo", "dr_grpo", "sequence", 0.0, 0.2),
]


@pytest.mark.parametrize("ours,theirs,level,beta,eps_high", CASES)
def test_each_loss_and_its_gradient_equal_trls_on_the_same_tensors(ours, theirs, level, beta, eps_high):
    for seed in range(3):
        tensors = _tensors(seed, beta)
        expected, metrics = _trl_loss(*tensors, theirs, level, beta, eps_high)
        (expected_grad,) = torch.autograd.grad(expected, tensors[0])
        loss, token, mask = _our_loss(*tensors, ours, level if ours != "gspo" else "token", beta, eps_high)
        (grad,) = torch.autograd.grad(loss, tensors[0])
        assert loss.item() == pytest.approx(expected.item(), abs=1e-6), seed
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
        assert grad[mask == 0].abs().max().item() == 0.0  # padding and tool results: outside the loss
        if ours == "cispo":
            flagged = (token.high_clipped.float() * mask).sum() / mask.sum()
            assert flagged.item() == pytest.approx(metrics["cispo_clip_ratio"][-1], abs=1e-6)


def test_tool_tokens_get_no_gradient_whatever_the_loss():
    """A tool's result is context: no loss type pulls on its log-probs."""
    for loss_type in grpo_loss.UNIT:
        logps, old, ref, completion_mask, tool_mask, advantages = _tensors(7, 0.04)
        loss, _, mask = _our_loss(logps, old, ref, completion_mask, tool_mask, advantages, loss_type, "token",
                                  0.04, 5.0 if loss_type == "cispo" else 0.2)
        (grad,) = torch.autograd.grad(loss, logps)
        assert grad[tool_mask == 0].abs().max().item() == 0.0, loss_type
        assert grad[mask == 1].abs().sum().item() > 0, loss_type


def test_gspo_has_one_ratio_per_completion_the_exponent_of_its_mean_log_ratio():
    logps, old, _, completion_mask, tool_mask, advantages = _tensors(2, 0.0)
    mask = (completion_mask * tool_mask).float()
    token = grpo_loss.per_token_loss(logps, old, None, advantages, 0.0, 0.2, 0.2, loss_type="gspo",
                                     sequence_level=True, mask=mask)
    assert token.ratio.shape == (B, 1)
    expected = torch.exp(((logps - old) * mask).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(token.ratio.squeeze(1), expected.detach(), atol=1e-6, rtol=0, check_dtype=False)
