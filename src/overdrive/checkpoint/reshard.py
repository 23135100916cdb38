"""Loading a checkpoint into a run of another world size or strategy (routes.py decides the route).

Each route uses the library that owns the format:

- ZeRO at a new world size: DeepSpeed's universal checkpoint. `ds_to_universal` rewrites the
  per-rank partitions as one file per parameter and state (fp32 weights, Adam moments, step),
  once, into `<checkpoint>/universal/` (a temporary directory renamed when complete, so a
  conversion killed half-way is never used), and the engine loads it with
  `checkpoint.load_universal` switched on for that one call.
- FSDP2 at a new world size: nothing to convert. Accelerate saved a
  `torch.distributed.checkpoint` directory, and DCP loads saved chunks into any sharding.
- Across strategies: the source's weights and optimizer state, keyed by parameter name, go
  through `torch.distributed.checkpoint.state_dict.set_state_dict`, which places them into the
  target's layout (DTensor shards for FSDP2, whole tensors for DDP). FSDP2 sources are read
  by DCP straight into the target's state dict; DDP and ZeRO sources are whole tensors (ZeRO's
  from its universal checkpoint).

The schedule, loss scaler and RNG states are the same files under every strategy; they are
read by Accelerate's own loaders. Only the main process converts; every rank loads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.checkpoint import store
from overdrive.checkpoint.routes import Route

UNIVERSAL = "universal"
CONVERSION = "conversion.json"
DEEPSPEED_TAG = "pytorch_model"  # the tag Accelerate's save_state gives DeepSpeed's save_checkpoint
# Accelerate's own files, beside the engine's: copied into the universal directory so that
# `load_state` finds everything in one place.
_ACCELERATE_FILES = ("random_states_", "custom_checkpoint_", "scaler", "scheduler", "sampler")


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- DeepSpeed universal checkpoint

def convert_to_universal(checkpoint: Path) -> tuple[Path, Optional[float]]:
    """`<checkpoint>/universal`, converted now if it is not there yet. Returns the directory and
    the seconds the conversion took (None when it was cached). Main process only."""
    target = checkpoint / UNIVERSAL
    if target.is_dir():
        return target, None
    from deepspeed.checkpoint import ds_to_universal

    for stale in checkpoint.glob(f"{store.TMP_PREFIX}{UNIVERSAL}-*"):  # a conversion that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = checkpoint / f"{store.TMP_PREFIX}{UNIVERSAL}-{os.getpid()}"
    started = time.perf_counter()
    args = argparse.Namespace(input_folder=str(checkpoint / DEEPSPEED_TAG), output_folder=str(tmp / DEEPSPEED_TAG),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # Accelerate's engines do not record the universal-checkpoint version that
                              # Megatron-DeepSpeed adds; the converter's own flag supplies it.
                              inject_missing_state=True)
    chatter = io.StringIO()  # the converter prints its progress; shown only if it fails
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"DeepSpeed's universal conversion of {checkpoint.name} failed:\n"
                           f"{chatter.getvalue()[-3000:]}") from None
    for item in checkpoint.iterdir():
        if item.is_file() and item.name.startswith(_ACCELERATE_FILES):
            shutil.copy2(item, tmp / item.name)
    seconds = time.perf_counter() - started
    record = {"seconds": seconds, "bytes": disk_bytes(tmp), "source_bytes": disk_bytes(checkpoint / DEEPSPEED_TAG)}
    (tmp / CONVERSION).write_text(json.dumps(record))
    for path in tmp.rglob("*"):
        store.fsync_path(path)
    os.replace(tmp, target)  # complete or absent: a killed conversion leaves only a .tmp- directory
    store.fsync_path(checkpoint)
    return target, seconds


def conversion_record(checkpoint: Path) -> Optional[dict]:
    """What the cached universal conversion of `checkpoint` cost, if it was converted."""
    try:
        return json.loads((checkpoint / UNIVERSAL / CONVERSION).read_text())
    except (OSError, ValueError):
        return None


class _Without(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def universal_loading(engine: Any):
    """DeepSpeed reads `checkpoint.load_universal` from its config at load time only: switched on
    for this one load, so the run's own later checkpoints stay in the ordinary format.

    ZeRO-3's universal loader (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    copies the first parameter group's hyperparameters into every group, which gives the
    biases and norm scales the matrices' weight decay. Each group's own values (everything
    but the learning rate, which the checkpoint's schedule sets) are put back afterwards.
    """
    config = engine._config
    before = config.load_universal_checkpoint
    groups = getattr(getattr(engine.optimizer, "optimizer", None), "param_groups", [])
    own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in groups]
    config.load_universal_checkpoint = True
    deepspeed_logger = logging.getLogger("DeepSpeed")
    no_tensor_parallelism = _Without("MPU is not provided")  # no tensor parallelism here: tp size 1 is right
    deepspeed_logger.addFilter(no_tensor_parallelism)
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
        deepspeed_logger.removeFilter(no_tensor_parallelism)
    for group, values in zip(groups, own):
        group.update(values)
    # The same loader gives every group one and the same `step` tensor; torch's AdamW
    # increments each group's step in place, so a shared one would count every step once per
    # group and skew Adam's bias correction. Each state gets its own.
    import torch

    for state in getattr(getattr(engine.optimizer, "optimizer", None), "state", {}).values():
        if "step" in state:
            step = state["step"]
            state["step"] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))


def _universal_tensors(directory: Path, name: str) -> dict[str, Any]:
    import torch

    folder = directory / DEEPSPEED_TAG / "zero" / name
    if not folder.is_dir():
        raise KeyError(f"the universal checkpoint has no parameter {name}")
    found = {}
    for state in ("fp32", "exp_avg", "exp_avg_sq", "step"):
        file = folder / f"{state}.pt"
        if file.exists():
            value = torch.load(file, map_location="cpu", weights_only=False)
            found[state] = value["param"] if isinstance(value, dict) else value
    return found


# ---------------------------------------------------------------- across strategies

def _named_optimizer_params(model: Any, optimizer: Any) -> tuple[list[list[str]], dict[str, tuple]]:
    """Per optimizer group, the names of its parameters (as in the unwrapped model's state dict),
    and each parameter's full shape (a DTensor's shape is the global one)."""
    names, shapes = {}, {}
    for name, param in model.named_parameters():
        for prefix in ("module.", "_orig_mod."):  # DDP and torch.compile wrappers
            name = name[len(prefix):] if name.startswith(prefix) else name
        names[id(param)] = name
        shapes[name] = tuple(param.shape)
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups], shapes


def _full_optimizer_state(groups: list[list[str]], optimizer: Any, saved_groups: list[dict],
                          state_of: Callable[[int, str], dict]) -> dict:
    """The FQN-keyed full optimizer state dict that `set_optimizer_state_dict` reads."""
    import torch

    state, param_groups, index = {}, [], 0
    for group_names, group, saved in zip(groups, optimizer.param_groups, saved_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper.update({k: saved[k] for k in ("lr", "initial_lr") if k in saved})
        param_groups.append({**hyper, "params": list(group_names)})
        for name in group_names:
            entry = state_of(index, name)
            if entry:
                step = entry.get("step", 0)
                entry["step"] = torch.tensor(float(step))  # its own tensor: AdamW increments it in place
                state[name] = entry
            index += 1
    return {"state": state, "param_groups": param_groups}


def _from_ddp(path: Path, groups: list[list[str]], shapes: dict, optimizer: Any) -> tuple[dict, dict]:
    import torch
    from safetensors.torch import load_file

    weights = path / "model.safetensors"
    model_sd = load_file(str(weights)) if weights.exists() else torch.load(path / "pytorch_model.bin",
                                                                            map_location="cpu")
    saved = torch.load(path / "optimizer.bin", map_location="cpu", weights_only=False)
    # DDP's optimizer state is keyed by position; the same model and parameter groups give the
    # same positions in every strategy (training/build/optimization.py param_groups).
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    optim_sd = _full_optimizer_state(groups, optimizer, saved["param_groups"],
                                     lambda index, name: dict(saved["state"].get(ids[index], {})))
    return model_sd, optim_sd


def _from_universal(directory: Path, groups: list[list[str]], shapes: dict, optimizer: Any) -> tuple[dict, dict]:
    import torch

    common = torch.load(directory / DEEPSPEED_TAG / "zero" / "optimizer_state.pt", map_location="cpu",
                        weights_only=False)
    # ZeRO-1/2 write a step per parameter; ZeRO-3 keeps one for all in the common state.
    base_state = common.get("optimizer_state_dict", {}).get("state", {})
    shared_step = next((entry.get("step") for entry in base_state.values() if "step" in entry), None)
    model_sd, moments = {}, {}
    for name in (n for g in groups for n in g):
        # ZeRO-3's universal files hold each parameter flattened.
        found = {k: v.view(shapes[name]) if k != "step" else v for k, v in _universal_tensors(directory, name).items()}
        model_sd[name] = found.pop("fp32")
        if "step" not in found and shared_step is not None:
            found["step"] = shared_step
        moments[name] = found
    optim_sd = _full_optimizer_state(groups, optimizer, common["param_groups"],
                                     lambda index, name: dict(moments[name]))
    return model_sd, optim_sd


def load_across(accelerator: Any, path: Path, route: Route, universal: Optional[Path]) -> None:
    """Weights and optimizer state of another strategy's checkpoint, placed by set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    # The prepared objects (the loop passes them to `prepare`, Accelerate keeps them).
    model, optimizer = accelerator._models[0], accelerator._optimizers[0]
    optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> torch optimizer
    if route.source.startswith("FSDP"):
        # DCP reads the saved shards straight into this run's own layout.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd}, checkpoint_id=str(path / "pytorch_model_fsdp_0"))
        dcp.load({"optimizer": optim_sd}, checkpoint_id=str(path / "optimizer_0"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        groups, shapes = _named_optimizer_params(model, optimizer)
        read = _from_universal if universal is not None else _from_ddp
        model_sd, optim_sd = read(universal if universal is not None else path, groups, shapes, optimizer)
        missing = sorted(set(shapes) - set(model_sd))
        if missing:
            raise KeyError(f"{len(missing)} parameters are not in the checkpoint, e.g. {', '.join(missing[:3])}")
        # Every parameter is there (checked above); a tied alias (GPT-2's lm_head is wte) is saved
        # once, so the load is not strict about the alias's second name.
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True, strict=False))
    _load_the_rest(accelerator, path)


def _load_the_rest(accelerator: Any, path: Path) -> None:
    """Schedule (a registered object), loss scaler and this rank's RNG: the same files in every
    strategy, read by Accelerate's own loaders."""
    from accelerate.checkpointing import load_accelerator_state, load_custom_state

    load_accelerator_state(str(path), [], [], [], [], accelerator.process_index, accelerator.scaler)
    for index, obj in enumerate(accelerator._custom_objects):
        load_custom_state(obj, str(path), index)
