"""The loop's GPU paths, run here on CPU tensors with Accelerate's side recorded: context
parallel's sequence buffers sharded around forward and backward, fp16-loaded weights trained in
fp32, and an fp16 step a fused optimizer skipped on overflow.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from conftest import cfg_of
import torch



# ------------------------------------------------------------------ context parallel in the loop


def _resilience_off(loop) -> None:
    """The loop's oom retry and loss-spike guard, as a run without training.oom_retry and
    training.loss_spike has them (they pass the step through)."""
    from overdrive.config.fault_injection import Injection
    from overdrive.training.guards import loss_spikes, oom_retry

    loop.spikes = loss_spikes.LossSpikes(loop.cfg, loop.parts.accelerator, loop.state, Injection(), 1)
    loop.oom = oom_retry.OomRetry(loop.cfg, loop.parts.accelerator, Injection())


class _RecordingAccelerator:
    """What the loop asks of Accelerate in one optimizer step, with context parallel recorded."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.num_processes, self.process_index = 1, 0
        self.sync_gradients = True
        self.optimizer_step_was_skipped = False
        self.scaler = None
        self.entered, self.inside = [], False
        self.forward_inside = self.backward_inside = None

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        self.entered.append((buffers, buffer_seq_dims, no_restore_buffers))
        self.inside = True
        yield
        self.inside = False

    @contextlib.contextmanager
    def accumulate(self, model):
        yield

    def backward(self, loss):
        self.backward_inside = self.inside
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_norm_(self, params, value):
        return torch.nn.utils.clip_grad_norm_(list(params), value)


def _bare_loop(cfg, acc, model, optimizer, scheduler, data, scaler=None):
    """A Loop over a recording accelerator: the step's real pieces (the objective, the plain
    forward-backward, the books), nothing of the run around it (checkpoint, observer, display)."""
    from overdrive.config import batch
    from overdrive.training import telemetry
    from overdrive.training.step import context_parallel, forward_backward
    from overdrive.training.guards import loss_scale, nonfinite
    from overdrive.training.loop import Loop, LoopState
    from overdrive.training.step.loss_tokens import LossTokens
    from overdrive.training.objectives.objective import TokenObjective

    loop = object.__new__(Loop)
    loop.cfg, loop.state, loop.split = cfg, LoopState(), batch.split(cfg)
    loop.parts = SimpleNamespace(accelerator=acc, model=model, optimizer=optimizer, scheduler=scheduler,
                                 objective=TokenObjective(cfg.model.task), forward_backward=forward_backward.plain,
                                 counts_loss_tokens=True,
                                 clip_grad_norm=lambda norm: acc.clip_grad_norm_(model.parameters(), norm))
    loop.model_parallel, loop.cp = 1, context_parallel.cp_size(cfg)  # one recording process
    loop.data = iter(data)
    loop.observe = SimpleNamespace(enter=lambda phase: None, step_done=lambda step: None)
    loop.progress = SimpleNamespace(step=lambda step: None)
    loop.loss_tokens, loop.throughput = LossTokens(acc.device, 0), telemetry.Throughput()
    loop.guard = nonfinite.NonfiniteGuard("skip", optimizer, acc.device, scaler=scaler)
    loop.scale_watch = loss_scale.ScaleWatch(scaler)
    loop.state.loss_sum = torch.zeros(())
    loop.grad_norm = None
    _resilience_off(loop)
    return loop


def _one_step(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    acc = _RecordingAccelerator()
    forward = model.forward

    def recording_forward(**kwargs):
        acc.forward_inside = acc.inside
        acc.forward_kwargs = kwargs
        return forward(**kwargs)

    model.forward = recording_forward
    ids = torch.randint(0, 32, (2, 8))
    micro_batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    from overdrive.config import batch

    loop = _bare_loop(cfg, acc, model, optimizer, schedule, [micro_batch] * batch.split(cfg).accumulation)
    loop.optimizer_step()
    return acc, ids


def test_the_loop_shards_the_sequence_buffers_around_forward_and_backward_when_cp_size_is_above_one():
    cp = cfg_of("parallel.strategy=fsdp", "parallel.cp_size=2", "launch.num_processes=2", "data.max_length=8",
                "training.micro_batch_size=2")
    acc, ids = _one_step(cp)
    assert len(acc.entered) == 1 and acc.forward_inside and acc.backward_inside
    buffers, dims, no_restore = acc.entered[0]
    given = acc.forward_kwargs
    # The model takes the sharded input_ids and position_ids; the loss (summed by the loop, over
    # the global batch's tokens) reads the sharded shift_labels.
    assert buffers[0] is given["input_ids"] and buffers[3] is given["position_ids"]
    assert dims == [1, 1, 1, 1] and {id(b) for b in no_restore} == {id(b) for b in buffers}
    # shift_labels made before sharding: position t predicts token t+1, the last predicts nothing.
    shift_labels = buffers[1]
    assert torch.equal(shift_labels[:, :-1], ids[:, 1:]) and (shift_labels[:, -1] == -100).all()
    assert torch.equal(given["position_ids"], torch.arange(8).expand(2, 8))
    assert "attention_mask" not in given  # Accelerate's CP hooks drop it: nothing may rely on it
    # Without context parallel the loop neither enters it nor changes the batch.
    acc, _ = _one_step(cfg_of("data.max_length=8", "training.micro_batch_size=2"))
    assert acc.entered == [] and "shift_labels" not in acc.forward_kwargs and "attention_mask" in acc.forward_kwargs


# ------------------------------------------------------------------ fp16 mixed precision on fp16 weights


def _unscale(model) -> None:
    """One fp16 step as Accelerate makes it off-CPU: autocast, GradScaler, unscale before clipping."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)


def test_fp16_mixed_precision_trains_fp16_weights_in_fp32():
    from overdrive.training.build import master_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).half()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        _unscale(model)  # what the first clipped step met
    model.zero_grad(set_to_none=True)
    model[0].weight.requires_grad_(False)  # a frozen base weight stays as loaded
    count = master_weights.upcast_trainable(cfg_of("precision.mixed_precision=fp16"), model)
    assert count == 3 and model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    _unscale(model)
    assert master_weights.note(count) and "fp32" in master_weights.note(count)[0]
    # bf16 needs no scaler; DeepSpeed's fp16 engine keeps its own fp32 masters.
    other = torch.nn.Linear(4, 4).half()
    assert master_weights.upcast_trainable(cfg_of("precision.mixed_precision=bf16"), other) == 0
    assert master_weights.upcast_trainable(cfg_of("precision.mixed_precision=fp16", "parallel.strategy=deepspeed"),
                                           other) == 0


# ------------------------------------------------------------------ fp16 overflow with a fused optimizer


class _Overflowing(torch.nn.Module):
    """A loss that overflows fp16 once scaled, for the first `bad` calls."""

    def __init__(self, bad: int):
        super().__init__()
        self.linear, self.bad = torch.nn.Linear(4, 4), bad

    def forward(self, input_ids, labels=None, attention_mask=None):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.linear(input_ids.float()).float().pow(2).mean()
        if self.bad:
            self.bad -= 1
            loss = loss * 1e38
        return SimpleNamespace(loss=loss)


def test_a_fused_adamw_step_skipped_by_the_fp16_scaler_holds_the_schedule_and_is_counted():
    """Accelerate says "not skipped" for a fused optimizer (the kernel skips on found_inf
    itself); the loop reads the scaler's scale, as Transformers' Trainer does."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
    cfg = cfg_of("precision.mixed_precision=fp16", "training.micro_batch_size=2", "training.gradient_clipping=null")
    model = _Overflowing(bad=1)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True),
                                     device_placement=False, scaler=scaler)
    acc = _RecordingAccelerator()
    acc.scaler = scaler
    type(acc).optimizer_step_was_skipped = property(lambda self: optimizer.step_was_skipped)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: s + 1.0)
    ids = torch.ones(2, 4)
    # A label per row: the loop takes the model's own loss (its mean x the rows).
    loop = _bare_loop(cfg, acc, model, optimizer, schedule,
                      [{"input_ids": ids, "labels": torch.zeros(2, dtype=torch.long)}] * 2, scaler=scaler)
    weights = model.linear.weight.detach().clone()
    loop.optimizer_step()  # overflows: the kernel leaves the weights, the scaler halves its scale
    assert torch.equal(model.linear.weight, weights) and not optimizer.step_was_skipped  # what Accelerate says
    assert schedule.last_epoch == 0 and loop.guard.read().scaler_skips == 1
    loop.optimizer_step()  # a finite step: applied, and the schedule moves
    assert not torch.equal(model.linear.weight, weights) and schedule.last_epoch == 1
