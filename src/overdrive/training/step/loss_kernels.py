"""A causal LM's summed token loss without the whole logits tensor (`training.loss_kernel`).

The model's own loss (`full`) projects every position onto the vocabulary: at 2,048 tokens and
Llama 3's 128,256 tokens that is 1 GB of fp32 logits, as much again for the log-softmax the cross
entropy keeps, and twice that for their gradients in backward: the largest tensors of the step for
a small model. Here the model runs through its own forward (whatever wraps it: DDP, FSDP2,
DeepSpeed's engine, PEFT, torch.compile) without labels, and for that one call the LM head's
`forward` is replaced (an instance attribute, removed after) by one that takes the final hidden
states and returns the kernel's summed loss, which the model hands back as its `.logits`. The
kernel so runs inside the head's own call, where each strategy's hooks put the head's weight in
place as they do for the model's own loss: FSDP2 unshards it in the head's (or the root's)
pre-forward and again for backward, ZeRO-3 gathers lm_head's parameters in its module pre-forward
hook and again in its pre-backward hook. One path for every strategy. Under torch.compile the
kernel runs eagerly (a graph break at the head, no recompilation from step to step). The head's
weight and the labels go to

- `chunked`: a loop over slices of the sequence, each slice's logits and cross entropy computed
  and dropped; backward recomputes one slice at a time and adds its share into the head's weight
  gradient in place (torchtune's and torchtitan's chunked loss, without a slice's separate weight
  gradient). An autograd Function: composes with what autograd does (not double backward);
- `fused`: Liger's fused linear cross entropy on CUDA when installed, else torch's own
  `F.linear_cross_entropy` with its chunked path (torch >= 2.13), which computes the gradients in
  forward and keeps only them (the weight's gradient, vocabulary x hidden, from forward to backward).

Both keep the model's shift (position t predicts label t+1), the ignore index -100 and the sum
over tokens that step_loss.summed_loss returns; the loop divides by the global token count.

GRPO's loss is not a cross entropy but a function of each completion token's log-probability
(training/objectives/grpo_loss.py): `chunked` computes those log-probs (and the entropies its metrics read)
the same way, a slice at a time through the head's own call (`completion_logps`), without the
completions' logits. `fused`'s kernels return a summed cross entropy only: GRPO refuses it by key.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from overdrive.config import loss_kernel as rule
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.resolving import validate_loss

IGNORE = -100
KEY = "training.loss_kernel"
def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformers model under DDP / DeepSpeed's engine (`.module`), torch.compile and PEFT."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        else:
            return model


def _own_class(module: torch.nn.Module) -> type:
    """The module's class under FSDP2's: fully_shard turns a module's class into `FSDP<Class>(FSDPModule, Class)`."""
    cls = type(module)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        if cls.__bases__[0] is FSDPModule and len(cls.__bases__) == 2:
            return cls.__bases__[1]
    return cls


def _head(model: torch.nn.Module) -> torch.nn.Linear:
    """The LM head as a plain linear layer, or the key refused: a head that is not one (a LoRA
    layer on lm_head, a quantised head) or logits the model rescales after it are the model's own."""
    config = getattr(model, "config", None)
    if validate_loss.rescales_logits(config):  # the rule explain and train judged before launch
        raise UserError(Problem(KEY, f"{_own_class(model).__name__} rescales its logits after the LM head "
                                "(soft-capping or a logit scale), which the loss kernels leave out",
                                fix=f"set {KEY}=full"))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # A subclass of Linear may be a quantised one (bitsandbytes'): only Linear itself, sharded or not.
    if _own_class(head) is not torch.nn.Linear or not head.weight.dtype.is_floating_point:
        raise UserError(Problem(KEY, f"{_own_class(model).__name__}'s LM head is {_own_class(head).__name__}, not a plain "
                                "linear layer (an adapter or quantisation on lm_head)", fix=f"set {KEY}=full"))
    return head


def _backward_buffers(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype):
    """The head in the forward's dtype, and the gradients a chunked backward fills slice by slice (fp32
    accumulators for the head's weight and bias; None where autograd asks for none)."""
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
    return w, b, grad_hidden, grad_weight, grad_bias


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of linear(hidden, weight, bias) against targets, a slice of tokens at a
    time. Forward keeps only its inputs; backward recomputes each slice's logits, turns them into
    their gradient in place (softmax minus the one-hot target) and adds the slice's share straight
    into the weight's gradient, so one slice's fp32 logits are the only vocabulary-wide tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, step):
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.step = step
        device = hidden.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], step):
            logits = F.linear(hidden[start:start + step], weight, bias).float()  # up-cast as Transformers' loss does
            total += F.cross_entropy(logits, targets[start:start + step], ignore_index=IGNORE, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype, step = ctx.dtype, ctx.step
        w, b, grad_hidden, grad_weight, grad_bias = _backward_buffers(ctx, hidden, weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], step):
                h = hidden[start:start + step].to(dtype)
                t = targets[start:start + step]
                grad = F.linear(h, w, b).float()
                # softmax in place (logsumexp would allocate a slice-sized temporary)
                grad.sub_(grad.amax(-1, keepdim=True)).exp_()
                grad.div_(grad.sum(-1, keepdim=True))
                kept = t != IGNORE
                rows = torch.arange(len(t), device=t.device)
                grad[rows, t.clamp(min=0)] -= kept.to(grad.dtype)  # minus the one-hot target
                grad.mul_((kept.to(grad.dtype) * grad_total).unsqueeze(-1))  # ignored tokens: no gradient
                g = grad.to(dtype)
                del grad
                if grad_hidden is not None:
                    grad_hidden[start:start + step] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(g.t().float() if dtype != torch.float32 else g.t(),
                                       h.float() if dtype != torch.float32 else h)
                if grad_bias is not None:
                    grad_bias += g.float().sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of (tokens, hidden) against (tokens,), one slice at a time (no logits kept)."""
    return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, rule.chunk_tokens(weight.shape[0]))


def fused_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy by a fused kernel: Liger's on CUDA when installed, else torch's chunked op."""
    if hidden.is_cuda and rule.liger_installed():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        # Liger's Triton kernels take one dtype: autocast's, as the model's own head would run in.
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")(
            weight.to(dtype), hidden.to(dtype), targets, bias.to(dtype) if bias is not None else None).float()
    if not hasattr(F, "linear_cross_entropy"):
        raise UserError(Problem(KEY, "`fused` needs Liger on CUDA (pip install overdrive[liger]) or torch >= 2.13",
                                fix=f"set {KEY}=chunked"))
    return F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="sum", ignore_index=IGNORE,
                                  options=torch.nn.LinearCrossEntropyOptions())


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"chunked": chunked_loss, "fused": fused_loss}


def _through_head(model: torch.nn.Module, inputs: dict, head_out: Callable[..., torch.Tensor],
                  shape: tuple) -> torch.Tensor:
    """The model's forward with its LM head's call answered by `head_out(head, hidden)`, whose
    result (of `shape`) the model hands back as its `.logits`."""
    inner = unwrapped(model)
    head = _head(inner)

    @torch.compiler.disable  # under torch.compile the kernel runs eagerly: a graph break at the head
    def head_call(hidden: torch.Tensor) -> torch.Tensor:
        # head.weight here is the one the strategy's hooks put in place for this call: whole under
        # FSDP2 (the head's unit's or the root's unshard) and ZeRO-3 (lm_head's gather); the same
        # parameter otherwise.
        return head_out(head, hidden)

    # For this one call only: an instance attribute shadows nn.Linear.forward, and module hooks
    # (FSDP2's, ZeRO-3's) still run around it. One another library set there is put back after.
    previous = head.__dict__.get("forward")
    head.forward = head_call
    try:
        out = model(**inputs, use_cache=False).logits
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
    if tuple(out.shape) != tuple(shape):  # logits made without calling the head (its weight used directly)
        raise UserError(Problem(KEY, f"{_own_class(inner).__name__} does not compute its logits by calling its "
                                "LM head", fix=f"set {KEY}=full"))
    return out


def summed_token_loss(model: torch.nn.Module, batch: dict, kernel: str) -> torch.Tensor:
    """This micro-batch's summed causal-LM loss by `kernel` ("chunked" or "fused"): the same number
    as the model's own loss with `num_items_in_batch=1`, computed inside the LM head's own call."""
    labels = batch["labels"]
    loss_of = LOSSES[kernel]

    def head_loss(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        # The model's shift: position t predicts label t+1; the last position predicts nothing.
        targets = labels[:, 1:].reshape(-1).to(hidden.device)
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return loss_of(hidden, head.weight, head.bias, targets)

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # All positions reach the head (logits_to_keep=0); what it returns is the summed loss.
    return _through_head(model, {**inputs, "logits_to_keep": 0}, head_loss, ())


class _ChunkedLogps(torch.autograd.Function):
    """Log-probabilities of the chosen tokens under softmax(linear(hidden, weight, bias) / T), and the
    entropies (no gradient), a slice of tokens at a time; backward recomputes each slice's logits
    and turns them into their gradient (the one-hot target minus the softmax, times the token's
    incoming gradient, over T), so one slice's fp32 logits are the only vocabulary-wide tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, step):
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.step = temperature, step
        device = hidden.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps)
        for start in range(0, hidden.shape[0], step):
            end = start + step
            scaled = torch.log_softmax(F.linear(hidden[start:end], weight, bias).float() / temperature, dim=-1)
            logps[start:end] = scaled.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
            entropy[start:end] = -(scaled.exp() * scaled).sum(-1)
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype, step, temperature = ctx.dtype, ctx.step, ctx.temperature
        w, b, grad_hidden, grad_weight, grad_bias = _backward_buffers(ctx, hidden, weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], step):
                h = hidden[start:start + step].to(dtype)
                t = targets[start:start + step]
                grad = torch.softmax(F.linear(h, w, b).float() / temperature, dim=-1).neg_()
                grad[torch.arange(len(t), device=t.device), t] += 1.0  # plus the one-hot target
                grad.mul_((grad_logps[start:start + step].float() / temperature).unsqueeze(-1))
                g = grad.to(dtype)
                del grad
                if grad_hidden is not None:
                    grad_hidden[start:start + step] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(g.t().float(), h.float())
                if grad_bias is not None:
                    grad_bias += g.float().sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of `targets`, entropies) of (tokens, hidden) under the head at `temperature`, by slices."""
    return _ChunkedLogps.apply(hidden, weight, bias, targets, temperature, rule.chunk_tokens(weight.shape[0]))


def completion_logps(model: torch.nn.Module, inputs: dict, completion_ids: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-probs, entropies) [B, C] of the completions that end each row of `inputs`,
    computed inside the LM head's own call a slice at a time (GRPO under `chunked`)."""
    rows, width = completion_ids.shape

    def head_logps(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        # The last width + 1 positions reach the head; each but the last predicts a completion token.
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        logps, entropy = chunked_logps(flat, head.weight, head.bias, completion_ids.reshape(-1).to(flat.device),
                                       temperature)
        return torch.stack([logps, entropy], dim=-1).view(rows, width, 2)

    out = _through_head(model, {**inputs, "logits_to_keep": width + 1}, head_logps, (rows, width, 2))
    return out[..., 0], out[..., 1]


def for_run(cfg: RunConfig, device: torch.device) -> str:
    """The kernel a run computes its token loss with (`auto` settled for this device and run)."""
    return validate_loss.kernel_runs(cfg, device.type)
