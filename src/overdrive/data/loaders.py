"""DataLoaders. The training loader uses whole global batches only, so every optimizer step
sees exactly micro x accumulation x world samples, also at the end of an epoch."""

from __future__ import annotations

from typing import Optional

import torch

import overdrive.config.batch as batch
from overdrive.data.samples import PadCollator
from overdrive.errors import Problem, UserError


def collate_for(kind: str, pad_id: Optional[int], max_length: Optional[int] = None):
    """The batch maker for a sample kind (`data.chat.sample_kind`): padding for classification
    and chat rows, none for packed text blocks (all one length)."""
    pad = pad_id if pad_id is not None else 0
    if kind == "unpaired":  # KTO's rows, with their KL sequences made per batch
        from overdrive.data.preference_unpaired import UnpairedCollator

        return UnpairedCollator(pad, max_length or 1 << 30)
    if kind == "preference":
        from overdrive.data.preference_samples import PairCollator

        return PairCollator(pad)
    if kind == "chat":
        from overdrive.data.chat_samples import ChatCollator

        return ChatCollator(pad)
    return PadCollator(pad) if kind == "sequence-classification" else None


class EpochShuffle(torch.utils.data.Sampler):
    """The first `num_samples` indices of a permutation seeded by seed + epoch.

    Each epoch's order is a function of the seed and the epoch number alone (not of how
    many epochs this process has iterated), so a run resumed in epoch 3 sees epoch 3's
    order, and skipping into it needs only the count of batches already taken.
    """

    def __init__(self, size: int, num_samples: int, seed: int, shuffle: bool = True):
        self.size, self.num_samples, self.seed, self.shuffle = size, num_samples, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # called through Accelerate's DataLoader wrapper
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator)[:self.num_samples].tolist())

    def __len__(self) -> int:
        return self.num_samples


def train_loader(dataset, micro_batch_size: int, accumulation: int, world_size: int, seed: int,
                 shuffle: bool = True, num_workers: int = 0, pin_memory: bool = False, collate_fn=None):
    """Batches for training, using a whole number of global batches per epoch.

    Rounding down to a multiple of micro x accumulation x world keeps every optimizer step
    the same size: otherwise Accelerate ends the accumulation early at the end of the data
    and that step averages over fewer samples.
    """
    global_batch = batch.of(micro_batch_size, accumulation, world_size).global_batch
    usable = (len(dataset) // global_batch) * global_batch
    if usable == 0:
        raise UserError(Problem(
            "training.micro_batch_size",
            f"the training data has {len(dataset)} samples, fewer than one global batch "
            f"({micro_batch_size} x {accumulation} accumulation x {world_size} processes = {global_batch})",
            fix="lower training.micro_batch_size or training.gradient_accumulation_steps, or give more data"))
    # A mixture orders its samples itself (data/mixing.py): read it in index order.
    sampler = EpochShuffle(len(dataset), usable, seed, shuffle and not getattr(dataset, "ordered", False))
    return torch.utils.data.DataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True, num_workers=num_workers,
        pin_memory=pin_memory, collate_fn=collate_fn, persistent_workers=num_workers > 0,
        generator=_own_generator(seed))


def _own_generator(seed: int) -> torch.Generator:
    # Every new iterator draws a worker seed from the loader's generator, or from the global
    # torch RNG when it has none; dropout draws from that one, so a loader without its own
    # would shift every dropout mask after an extra iterator (a resume, an evaluation).
    return torch.Generator().manual_seed(seed)


def eval_loader(dataset, batch_size: int, num_workers: int = 0, pin_memory: bool = False, collate_fn=None):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                       pin_memory=pin_memory, collate_fn=collate_fn,
                                       persistent_workers=num_workers > 0,  # evaluated again and again
                                       generator=_own_generator(0))
