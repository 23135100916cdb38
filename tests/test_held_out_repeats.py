"""The held-out loss counts each row once on any number of processes: the rows Accelerate repeats to
even out the ranks' last batches are out of the loss (training/objectives/objective.without_repeats), a
classifier's too (its rows' cross entropy, the repeated rows left out)."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from overdrive.training.objectives.objective import classifier_rows_loss, repeated_rows, without_repeats


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


def test_a_classifiers_held_out_loss_sums_every_row_once_over_the_ranks():
    n, micro, world, classes = 7, 2, 4, 3
    logits = torch.randn(n, classes, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([i % classes for i in range(n)])
    rows = [{"row": torch.tensor(i), "labels": labels[i]} for i in range(n)]
    loss, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for rank in range(world):
        loader = torch.utils.data.DataLoader(rows, batch_size=micro, collate_fn=_collate)
        shard = prepare_data_loader(loader, torch.device("cpu"), num_processes=world, process_index=rank,
                                    put_on_device=False, even_batches=True)
        for batch in shard:
            scores = logits[batch["row"]]
            out = SimpleNamespace(logits=scores, loss=torch.nn.functional.cross_entropy(scores, batch["labels"]))
            summed, rows_here = classifier_rows_loss(out, batch["labels"], repeated_rows(shard, len(batch["labels"]), "cpu"))
            loss, count = loss + summed, count + rows_here
    assert int(count) == n
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))


@pytest.mark.parametrize("method", ["dpo", "orpo", "reward", "kto"])
def test_the_preference_held_out_loss_and_metrics_count_every_pair_once_over_the_ranks(method):
    from test_composition import _cfg, _tiny

    from overdrive.training.objectives.preference import PreferenceObjective

    n, micro, world, length = 7, 2, 4, 10
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 23, (2 * n, length), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    rows = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    if method == "kto":  # unpaired rows, desirable and not, with their KL sequences (the rows rotated)
        rows = {**rows, "desirable": torch.arange(2 * n) % 3 != 0,
                **{f"kl_{k}": v.roll(1, 0) for k, v in rows.items()}}
        n *= 2

        def collate(index: list) -> dict:
            return {k: v[torch.stack(index)] for k, v in rows.items()}
    else:
        def collate(index: list) -> dict:  # chosen rows, then rejected rows
            picked = torch.stack(index)
            return {k: torch.cat([v[picked], v[n + picked]]) for k, v in rows.items()}

    task = "sequence-classification" if method == "reward" else "causal-lm"
    model = _tiny(task)
    cfg = _cfg("data.format=preference", f"preference.method={method}", "data.packing=false", f"model.task={task}")

    def reference(model, batch):
        return -batch["input_ids"].sum(dim=1).float() / 50

    def evaluate(world: int, rank: int) -> list[torch.Tensor]:
        """What this rank's evaluate hands the all-reduces: its metric sums, loss sums and units."""
        reduced = []
        accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, num_processes=1,
                                      reduce=lambda tensor, how="sum": reduced.append(tensor.clone()) or tensor)
        objective = PreferenceObjective(cfg, accelerator, reference=reference, eval_reference=reference)
        loader = torch.utils.data.DataLoader([torch.tensor(i) for i in range(n)], batch_size=micro, collate_fn=collate)
        shard = prepare_data_loader(loader, torch.device("cpu"), num_processes=world, process_index=rank,
                                    put_on_device=False, even_batches=True)
        objective.evaluate(model, shard)
        return [t for t in reduced if t.dim() == 1]  # KTO's mean over ranks of its KL estimate is a scalar

    one = evaluate(1, 0)
    ranks = [evaluate(world, rank) for rank in range(world)]
    for got, expected in zip([sum(r[i] for r in ranks) for i in range(len(one))], one):
        if method == "kto" and len(expected) == 8:  # its KL estimate is a mean over batches (TRL's): split-dependent
            got, expected = got[:-2], expected[:-2]
        assert torch.allclose(got.double(), expected.double(), rtol=1e-5, atol=1e-6), (method, got, expected)
