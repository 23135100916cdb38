"""`training.activation_offloading`: the tensors the forward pass saves for backward kept in host memory.

Between a layer's forward and its backward its saved activations sit idle on the device; here they
are copied to pinned host memory as they are saved and brought back when backward unpacks them
(torch's saved-tensor hooks, as torchtune's and TRL's offloading do). Left on the device:
parameters and views of them (a linear layer saves its weight; copying it would move the model
every step), small tensors (not worth a copy), and anything already on the host: on a CPU run the
activations are in host memory already and nothing changes. Composes with gradient checkpointing:
a checkpointed layer's own hooks handle what it recomputes, these handle what stays (the layer inputs).
"""

from __future__ import annotations

from typing import Any

import torch

MIN_BYTES = 1 << 20  # below this a copy costs more than it frees


def _stays(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return (tensor.device.type == "cpu" or isinstance(base, torch.nn.Parameter)
            or tensor.numel() * tensor.element_size() < MIN_BYTES)


def _pack(tensor: torch.Tensor) -> Any:
    if _stays(tensor):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=True)  # same stream as the unpack's copy back: ordered
    return (tensor.device, host)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offloading() -> torch.autograd.graph.saved_tensors_hooks:
    """The context under which a forward's saved activations go to host memory."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def attach(model: torch.nn.Module, enabled: bool) -> None:
    """Every forward of `model` (training steps, preference pairs) offloads its saved activations.
    The context opens in a forward pre-hook and closes in a forward hook that runs even when the
    forward raises, so a failed step leaves no hooks behind."""
    if not enabled:
        return
    open_contexts: list[Any] = []

    def enter(_module: torch.nn.Module, _args: Any) -> None:
        context = offloading()
        context.__enter__()
        open_contexts.append(context)

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if open_contexts:
            open_contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
