"""`training.activation_offloading`: the saved-tensor hooks open and close with every forward (a
failed one too), keep parameters and host tensors where they are, and change no number."""

from __future__ import annotations

import pytest
import torch

from overdrive.training.step import activation_offload


def _hooks_open() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_offloading_changes_no_gradient_and_closes_after_every_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    before = _grads(model, x)
    activation_offload.attach(model, True)
    assert all(torch.equal(a, b) for a, b in zip(before, _grads(model, x)))
    assert not _hooks_open()
    with pytest.raises(RuntimeError):
        model(torch.randn(5, 3))  # a failed forward closes them too
    assert not _hooks_open()


def test_parameters_and_host_tensors_stay_where_they_are():
    weight = torch.nn.Parameter(torch.randn(1024, 512))
    assert activation_offload._pack(weight) is weight
    assert activation_offload._pack(weight.t()) is not None and activation_offload._stays(weight.t())
    big = torch.randn(1024, 1024)  # 4 MB, but already in host memory
    assert activation_offload._pack(big) is big


def test_off_attaches_nothing():
    model = torch.nn.Linear(2, 2)
    activation_offload.attach(model, False)
    assert not model._forward_pre_hooks and not model._forward_hooks
