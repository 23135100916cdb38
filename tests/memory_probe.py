"""Count the bytes each rank really holds, for tests/test_memory_strategies.py.

Run as a worker under torch.distributed.run:

    python -m torch.distributed.run --nproc_per_node 2 tests/memory_probe.py --config run.json --out probe.json

Builds the Accelerator through `build_accelerator` (DDP, DeepSpeed ZeRO-1/2/3 or FSDP2, on
CPU over gloo), prepares a GPT-2 from `model.architecture` with the trainer's AdamW
parameter groups, runs one optimizer step and counts unique tensor storages per rank:

- params: the module's parameters (FSDP2: local shards; ZeRO-1/2: the flat 16-bit groups;
  ZeRO-3: partitions `ds_tensor` and whatever stays gathered).
- master: DeepSpeed's fp32 partitions (`single_partition_of_fp32_groups`,
  `fp32_partitioned_groups_flat`) where they are not the parameters themselves.
- optimizer: the tensors in the torch optimizer's `state` (exp_avg, exp_avg_sq, step).
- grads: the largest of several snapshots - after backward, and for DeepSpeed also before
  and after its gradient reduction and inside the inner optimizer's step, where it has
  built the fp32 gradient partition. Reduce buckets are not gradients (they are buffers).

Rank 0 writes {"ranks": [{"params": .., "grads": .., "optimizer": .., "master": ..,
"grad_snapshots": {..}}, ...], "distributed_type": ..}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def storage_key(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    if t is None or t.device.type == "meta" or t.numel() == 0:
        return None
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes())


def total(tensors, exclude=frozenset()) -> tuple[int, set]:
    keys = {k for k in (storage_key(t) for t in tensors if t is not None) if k is not None}
    keys -= set(exclude)
    return sum(n for _, n in keys), keys


def flatten(obj):
    """Tensors inside nested lists, tuples and dicts."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from flatten(v)


class Counter:
    def __init__(self, model, optimizer, engine=None):
        self.model, self.optimizer, self.engine = model, optimizer, engine
        self.zero = getattr(engine, "optimizer", None) if engine is not None else None
        self.snapshots: dict[str, int] = {}

    def param_tensors(self):
        for p in self.model.parameters():
            yield p
            if hasattr(p, "ds_tensor"):
                yield p.ds_tensor
        if self.zero is not None:
            yield from flatten(getattr(self.zero, "bit16_groups_flat", []))
            yield from flatten(getattr(self.zero, "fp16_partitioned_groups_flat", []))

    def master_tensors(self):
        if self.zero is not None:
            yield from flatten(getattr(self.zero, "single_partition_of_fp32_groups", []))
            yield from flatten(getattr(self.zero, "fp32_partitioned_groups_flat", []))

    def buffer_keys(self):
        buckets = getattr(self.zero, "ipg_buckets", {}) if self.zero is not None else {}
        return {storage_key(t) for b in buckets.values() for t in flatten(getattr(b, "buffer", []))} - {None}

    def grad_tensors(self):
        for p in self.model.parameters():
            yield p.grad
            yield getattr(p, "grad_accum", None)
        for t in self.master_tensors():
            yield t.grad
        z = self.zero
        if z is not None:
            yield from flatten(getattr(z, "averaged_gradients", {}))
            yield from flatten(getattr(z, "all_grad_tensors", {}))
            yield getattr(z, "grads_in_partition", None)
            yield getattr(z, "grad_partitions_flat_buffer", None)

    def snapshot(self, name: str) -> None:
        _, params = total(self.param_tensors())
        _, master = total(self.master_tensors())
        nbytes, _ = total(self.grad_tensors(), params | master | self.buffer_keys())
        self.snapshots[name] = max(nbytes, self.snapshots.get(name, 0))

    def result(self) -> dict:
        params, pkeys = total(self.param_tensors())
        master, _ = total(self.master_tensors(), pkeys)
        base = getattr(self.zero, "optimizer", None) or getattr(self.optimizer, "optimizer", self.optimizer)
        optimizer, _ = total(flatten(list(base.state.values())))
        return {"params": params, "master": master, "optimizer": optimizer, "grads": max(self.snapshots.values()),
                "grad_snapshots": dict(self.snapshots)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="RunConfig as JSON")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from overdrive.config.schema import RunConfig
    from overdrive import build_accelerator

    cfg = RunConfig.model_validate_json(Path(args.config).read_text())
    accelerator = build_accelerator(cfg)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from overdrive.training.build.optimization import param_groups

    torch.manual_seed(0)
    arch = {k: v for k, v in cfg.model.architecture.items() if k != "model_type"}
    model = GPT2LMHeadModel(GPT2Config(**arch))
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = model if hasattr(model, "allreduce_gradients") else None
    counter = Counter(model, optimizer, engine)

    ids = torch.randint(0, arch["vocab_size"], (cfg.training.micro_batch_size, cfg.data.max_length))
    loss = model(input_ids=ids, labels=ids).loss
    if engine is not None:
        # DeepSpeed: wrap the points between which gradients change hands.
        reduce = engine.allreduce_gradients

        def allreduce_gradients(*a, **k):
            counter.snapshot("before_reduce")
            out = reduce(*a, **k)
            counter.snapshot("after_reduce")
            return out

        engine.allreduce_gradients = allreduce_gradients
        inner = engine.optimizer.optimizer
        inner.register_step_pre_hook(lambda *_: counter.snapshot("in_step"))
        engine.backward(loss)
        counter.snapshot("after_backward")
        engine.step()
    else:
        accelerator.backward(loss)
        counter.snapshot("after_backward")
        optimizer.step()
    result = counter.result()

    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, result)
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"ranks": gathered, "distributed_type": str(accelerator.distributed_type),
                                              "num_processes": accelerator.num_processes}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
    from overdrive.cli import exit_worker

    exit_worker(0)  # as overdrive's own workers leave: gloo/DeepSpeed's native teardown can abort
