"""The reference model of DPO and IPO, built with the parts (training/build/parts.py):

    for_run        the reference callable for the run: the adapter disabled (LoRA), a frozen copy
                   of the starting weights, or log-probs computed once (`preference.precompute_reference`)
    precompute     every pair's reference log-probs with the starting weights, each rank scoring its
                   share in lock step (sharded models gather their parameters together), kept in
                   output_dir/reference_logps.pt, keyed by the pairs; a resumed run reads it back
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from overdrive.training.objectives import preference

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

CACHE = "reference_logps.pt"


def frozen_copy(cfg: RunConfig, model) -> Optional[torch.nn.Module]:
    """Before `prepare`: the starting weights as a frozen model, when the run needs one (full-parameter
    DPO/IPO without precomputed log-probs; the validation keeps sharded strategies off this path)."""
    needs = preference.needs_reference(cfg) or (cfg.rl.method != "none" and cfg.rl.beta != 0.0)  # GRPO's KL
    if not needs or cfg.peft.method != "none" or cfg.preference.precompute_reference:
        return None
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def pairs_key(dataset) -> str:
    """The pairs a cached table belongs to: a hash of their sequence ends and a sample of their ids."""
    rows = dataset.conversations
    digest = hashlib.sha256(np.asarray(rows.ends).tobytes())
    digest.update(np.asarray(rows.ids[:4096]).tobytes())
    return digest.hexdigest()


def precompute(model, dataset, collate, micro_batch: int, accelerator, out: Path, name: str = CACHE) -> torch.Tensor:
    """[pairs, 2] reference log-probs (chosen, rejected), read from output_dir or computed now."""
    path, key = out / name, pairs_key(dataset)
    if path.is_file():
        saved = torch.load(path, map_location="cpu")
        if saved.get("key") == key:
            return saved["logps"]
    world, rank, n = accelerator.num_processes, accelerator.process_index, len(dataset)
    per_rank = -(-n // world)
    mine = [min(rank + world * i, n - 1) for i in range(per_rank)]  # padded: every rank runs as many forwards
    values = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, per_rank, micro_batch):
            batch = collate([dataset[i] for i in mine[start:start + micro_batch]])
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            logps, _, _ = preference.sequence_scores(model, batch)
            half = len(logps) // 2
            values.append(torch.stack([batch["pair_index"].double(), logps[:half].double(),
                                       logps[half:].double()], dim=1))
    model.train(was_training)
    rows = accelerator.gather(torch.cat(values)).cpu()
    table = torch.zeros(n, 2, dtype=torch.float64)
    table[rows[:, 0].long()] = rows[:, 1:]
    if accelerator.is_main_process:
        from overdrive.storage import faults

        out.mkdir(parents=True, exist_ok=True)
        with faults.writing(path, "output_dir", what="the reference log-probs"):
            tmp = path.with_suffix(".tmp")
            torch.save({"key": key, "logps": table}, tmp)
            tmp.replace(path)
    accelerator.wait_for_everyone()
    return table


def for_run(cfg: RunConfig, accelerator, model, reference_model, dataset, collate, micro_batch: int, out: Path,
            validation=None):
    """(reference for training, reference for validation) after `prepare`; (None, None) for
    methods without one."""
    if not preference.needs_reference(cfg):
        return None, None
    if cfg.preference.precompute_reference:
        train = preference.cached_reference(precompute(model, dataset, collate, micro_batch, accelerator, out))
        held = None
        if validation is not None:
            held = preference.cached_reference(precompute(model, validation, collate, micro_batch, accelerator, out,
                                                          "reference_logps_validation.pt"))
        return train, held
    if cfg.peft.method != "none":
        same = preference.lora_reference(accelerator)
    else:
        same = preference.frozen_reference(reference_model.to(accelerator.device), accelerator)
    return same, same
