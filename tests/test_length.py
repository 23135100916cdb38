"""How long a run is: max_steps or num_epochs, warmup_steps or warmup_ratio (the later-set wins,
both in one file refused), and the steps, warmup, evaluations and saves counted from the data."""

from __future__ import annotations

import pytest

from overdrive.config.length import derived
from overdrive.errors import UserError
from overdrive.resolving import resolve


def resolved(*cli, files=()):
    return resolve(list(files), cli=list(cli), env={}, accelerate_default=False)


def test_the_later_layer_decides_and_the_other_is_named(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("training:\n  num_epochs: 3\nscheduler:\n  warmup_ratio: 0.1\n")
    by_file = resolved(files=[run])
    assert by_file.config.training.num_epochs == 3 and by_file.origins["training.max_steps"].layer == "derived"
    later = resolved("max_steps=10", "scheduler.warmup_steps=2", files=[run])
    assert (later.config.training.max_steps, later.config.training.num_epochs) == (10, None)
    assert (later.config.scheduler.warmup_steps, later.config.scheduler.warmup_ratio) == (2, None)
    assert {"training.num_epochs", "scheduler.warmup_ratio"} <= {w.key for w in later.warnings}
    ratio = resolved("max_steps=10", "scheduler.warmup_ratio=0.25")  # with max_steps: settled at once
    assert ratio.config.scheduler.warmup_steps == 3 and ratio.origins["scheduler.warmup_steps"].layer == "derived"


def test_both_in_one_file_are_refused_by_key(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("training:\n  max_steps: 100\n  num_epochs: 2\n")
    with pytest.raises(UserError) as error:
        resolved(files=[run])
    assert [p.key for p in error.value.problems] == ["training.num_epochs"]


def test_steps_warmup_evaluations_and_saves_counted_from_the_samples():
    cfg = resolved("training.num_epochs=2.5", "scheduler.warmup_ratio=0.1", "training.evals_per_epoch=4",
                   "checkpoint.saves_per_epoch=2", "mbs=4", "accum=2").config
    counted, why = derived(cfg, samples=100, global_batch=8)  # 12 steps per epoch (the last partial batch dropped)
    assert (counted.training.max_steps, counted.scheduler.warmup_steps) == (30, 3)
    assert (counted.training.eval_every_steps, counted.checkpoint.every_steps) == (3, 6)
    assert "12 steps per epoch" in why["training.max_steps"]
    with pytest.raises(ValueError):
        derived(cfg, samples=7, global_batch=8)
    plain = resolved("max_steps=50").config
    assert derived(plain, 100, 8) == (plain, {})
