"""The held-out loss counts each row once on any number of processes: the rows Accelerate repeats to
even out the ranks' last batches are out of the loss (training/objectives/objective.without_repeats)."""

import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from overdrive.training.objectives.objective import without_repeats


def _collate(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _rows_in_the_loss(n: int, micro: int, world: int, drop_repeats: bool) -> list[int]:
    seen = []
    rows = [{"input_ids": torch.tensor([i, i]), "labels": torch.tensor([i, i])} for i in range(n)]
    for rank in range(world):
        loader = torch.utils.data.DataLoader(rows, batch_size=micro, collate_fn=_collate)
        shard = prepare_data_loader(loader, torch.device("cpu"), num_processes=world, process_index=rank,
                                    put_on_device=False, even_batches=True)
        for batch in shard:
            batch = without_repeats(shard, batch) if drop_repeats else batch
            seen += [int(r[0]) for r in batch["labels"] if (r != -100).any()]
    return sorted(seen)


@pytest.mark.parametrize("n, micro, world", [(6, 4, 2), (6, 2, 2), (3, 4, 2), (7, 2, 4), (5, 1, 3), (8, 2, 2)])
def test_every_held_out_row_is_in_the_loss_once_whatever_the_ranks(n, micro, world):
    assert _rows_in_the_loss(n, micro, world, drop_repeats=True) == list(range(n))


def test_without_it_the_ranks_last_batches_repeat_rows():
    assert _rows_in_the_loss(6, 4, 2, drop_repeats=False) == [0, 0, 1, 1, 2, 3, 4, 5]
