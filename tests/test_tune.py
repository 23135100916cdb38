"""The tuner: its space keeps the math, pruning, the race, scoring, and the command end to end
(tuned.yaml as a `tune` layer, no overwrite, the chart, the cache answering without torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from overdrive.resolving import resolve
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.tune import output
from overdrive.tune.search import Search, SearchSettings
from overdrive.tune.space import Facts, build_space, prune
from overdrive.tune.trials import Measurement, Outcome, Rung, TrialPlan

CPU = Facts(cpu_cores=2, gpu=False, supports_bf16=True, compiler="g++")
TINY = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_bytes": 60_000, "max_length": 32},
    "training": {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 40},
    "scheduler": {"warmup_steps": 2},
}


def config(**training) -> RunConfig:
    data = json.loads(json.dumps(TINY))
    data["training"].update(training)
    return RunConfig.model_validate(data)


def micro_accum(candidate) -> tuple[int, int]:
    o = candidate.overrides()
    return o["training.micro_batch_size"], o["training.gradient_accumulation_steps"]


# ------------------------------------------------------------------ the space

def test_every_candidate_keeps_the_global_batch():
    space = build_space(config(micro_batch_size=8, gradient_accumulation_steps=2), CPU)
    grid = space.grid()
    assert len(grid) == 4 * 2 * 2 * 1 * 2 * 2 * 2  # batch, precision, ckpt, strategy, compile, workers, threads
    assert {m * a for m, a in map(micro_accum, grid)} == {16}
    assert [o.label for o in space.dimensions["batch"]] == [
        "micro 16 x accum 1", "micro 8 x accum 2", "micro 4 x accum 4", "micro 2 x accum 8"]
    assert [o.short for o in space.dimensions["precision"]] == ["no", "bf16"]  # no fp16 on a CPU
    assert [o.short for o in space.dimensions["strategy"]] == ["ddp"]  # one process: nothing to shard
    assert grid[0].key == space.baseline.key == ("micro 8 x accum 2", "no", "ckpt off", "ddp", "eager", "workers 0",
                                                 "threads 2")


def test_several_processes_add_zero_stages_and_fsdp_and_no_compiler_means_eager():
    cfg = RunConfig.model_validate({**TINY, "launch": {"num_processes": 2}})
    space = build_space(cfg, Facts(2, False, True, compiler="", compile_note="no C++ compiler"))
    assert [o.short for o in space.dimensions["strategy"]] == ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
    assert [o.short for o in space.dimensions["compile"]] == ["eager"]
    assert any("no C++ compiler" in note for note in space.notes)
    assert {m * a * 2 for m, a in map(micro_accum, space.grid())} == {16}
    assert [o.short for o in space.dimensions["threads"]] == ["1"]  # 2 cores shared by 2 processes


def test_auto_micro_batch_needs_the_global_batch_it_keeps():
    with pytest.raises(UserError, match="training.global_batch_size"):
        build_space(config(micro_batch_size="auto"), CPU)
    space = build_space(config(micro_batch_size="auto", global_batch_size=12), CPU)
    assert {m * a for m, a in map(micro_accum, space.grid())} == {12}
    with pytest.raises(UserError, match="global_batch_size"):  # contradicting an integer micro-batch
        build_space(config(micro_batch_size=8, global_batch_size=12), CPU)


def test_only_narrows_a_dimension_but_keeps_the_configuration_as_given():
    space = build_space(config(), CPU, only={"batch": ["4"], "compile": ["eager"], "threads": ["1"]})
    assert [o.short for o in space.dimensions["batch"]] == ["8", "4"]  # 8 is the baseline's
    assert [o.short for o in space.dimensions["threads"]] == ["2", "1"]
    with pytest.raises(UserError, match="unknown tuning dimension"):
        build_space(config(), CPU, only={"speed": ["max"]})


def test_the_estimator_prunes_and_checkpointing_is_tried_only_where_it_is_needed():
    space = build_space(config(), CPU, only={"compile": ["eager"], "workers": ["0"], "threads": ["2"],
                                             "precision": ["no"]})

    def fits(c):  # without checkpointing only micro <= 4 fits; with it, up to 8
        micro = c.overrides()["training.micro_batch_size"]
        return micro <= (8 if c.overrides()["model.gradient_checkpointing"] else 4), micro * 1000

    grid = space.grid()
    kept = prune(grid, fits, space)
    by_status: dict[str, list] = {}
    for c in grid:
        by_status.setdefault(c.status, []).append(micro_accum(c)[0] if c.option("checkpointing").short == "off"
                                                  else f"{micro_accum(c)[0]}+ckpt")
    assert by_status["pruned"] == [8]
    assert sorted(by_status["dominated"], key=str) == ["1+ckpt", "2+ckpt", "4+ckpt"]
    assert sorted(by_status["pending"], key=str) == sorted([1, 2, 4, "8+ckpt"], key=str)
    assert len(kept) == 4


# ------------------------------------------------------------------ measuring and scoring

def measurement(step_s: float, steps: int, warmup_s: float = 0.3, tokens: int = 256) -> Measurement:
    m = Measurement(warmup_steps=3)
    total = 0
    for i in range(1, steps + 1):
        seconds = warmup_s / 3 if i <= 3 else step_s
        total += tokens
        m.add({"step": i, "loss": 5.0, "tokens": total, "tokens_per_s": tokens / seconds, "peak_memory_mb": 100 + i})
    return m


def test_warm_up_is_excluded_and_compile_time_is_paid_back_only_on_long_runs():
    eager = measurement(0.010, 23, warmup_s=0.03)
    compiled = measurement(0.007, 23, warmup_s=30.0)  # 30% faster steps after 30 s of compiling
    assert eager.tokens_per_s() == pytest.approx(25_600) and compiled.tokens_per_s() == pytest.approx(256 / 0.007)
    assert compiled.overhead_s() == pytest.approx(30.0 - 3 * 0.007)
    assert eager.peak_memory_mb == 123 and len(eager.step_s) == 20
    assert compiled.run_tokens_per_s(300) < eager.run_tokens_per_s(300)  # 3 s of steps cannot repay 30 s
    assert compiled.run_tokens_per_s(100_000) > eager.run_tokens_per_s(100_000)


def test_a_full_measurement_is_20_steps_unless_the_steps_are_very_slow():
    final = TrialPlan.measuring(6.0).rungs[-1]
    assert not measurement(0.1, 3 + 19).reached(final) and measurement(0.1, 3 + 70).reached(final)
    assert not measurement(3.0, 3 + 4).reached(final)  # 12 s: not yet 3 x 6 s
    assert measurement(4.0, 3 + 5).reached(final)  # 20 s over 5 steps: slow enough to know


def fake_search(speeds: dict[str, float], mode: str = "staged", budget_s=None, clock=None):
    """A search whose trials are simulated from a per-micro-batch step time."""
    space = build_space(config(micro_batch_size=8, gradient_accumulation_steps=2), CPU,
                        only={"precision": ["no"], "compile": ["eager"], "workers": ["0"], "threads": ["2"]})
    plan = TrialPlan(warmup_steps=3, rungs=(Rung(3, 0, 3), Rung(8, 0, 8), Rung(20, 0, 20)))
    calls = []

    def run(candidate, decide):
        calls.append(candidate.label)
        step = speeds[str(micro_accum(candidate)[0])]
        m = Measurement(warmup_steps=3)
        full = measurement(step, 23)
        m.step_tokens, m.warmup_s = full.step_tokens, full.warmup_s
        m.steps = 3
        for k, rung in enumerate(plan.rungs):
            m.step_s = full.step_s[: rung.min_steps]
            m.rung_steps.append(rung.min_steps)
            if k < len(plan.rungs) - 1 and decide and (reason := decide(k, m)):
                return Outcome("stopped", reason, m)
        return Outcome("ok", "", m)

    settings = SearchSettings(mode=mode, run_steps=1000, budget_s=budget_s)
    search = Search(space, settings, plan, run, fits=lambda c: (True, 1), **({"clock": clock} if clock else {}))
    return search, search.execute(), calls


def test_the_race_stops_slow_candidates_early_and_keeps_the_fastest():
    speeds = {"16": 0.004, "8": 0.010, "4": 0.012, "2": 0.020}
    search, candidates, calls = fake_search(speeds)
    best = search.ok()[0]
    assert micro_accum(best) == (16, 1)
    statuses = {micro_accum(c)[0]: c.status for c in candidates if c.status in ("ok", "stopped")}
    assert statuses == {8: "ok", 16: "ok", 4: "stopped", 2: "stopped"}  # 8 is the baseline, measured first
    stopped = [c for c in candidates if c.status == "stopped"]
    assert all(len(c.measurement.step_s) == 3 and "rung 1" in c.reason for c in stopped)
    # The grid measures all four in full: the race spent 3+3 timed steps where the grid spends 20+20.
    _, grid, grid_calls = fake_search(speeds, mode="grid")
    assert sorted(c.status for c in grid if c.status != "pruned") == ["ok"] * 8  # ckpt on included
    assert len(grid_calls) == 8 and len(calls) == 4


def test_a_budget_stops_starting_trials():
    ticks = iter(range(0, 10_000, 100))
    search, candidates, calls = fake_search({"16": 0.004, "8": 0.01, "4": 0.012, "2": 0.02}, budget_s=250,
                                            clock=lambda: next(ticks))
    assert len(calls) == 2 and search.ok()
    assert any(c.status == "skipped" and "budget" in c.reason for c in candidates)


# ------------------------------------------------------------------ the command, end to end

def write_tiny(tmp_path: Path, cache: Path) -> Path:
    data = json.loads(json.dumps(TINY))
    data["data"]["cache_dir"] = str(cache)
    # One thread: two OpenMP threads on a shared, busy 2-core machine can make steps 100x
    # slower (each parallel region waits for a descheduled thread), and this test wants speed.
    data["launch"] = {"threads_per_process": 1}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def tuned_once(tmp_path_factory):
    """One real `overdrive tune` (trials in fresh processes), shared by the tests below."""
    from overdrive.cli import main

    tmp = tmp_path_factory.mktemp("tune")
    run_yaml = write_tiny(tmp, tmp / "cache")
    argv = ["tune", str(run_yaml), "--only", "batch=4", "--only", "precision=no", "--only", "compile=eager",
            "--only", "workers=0", "--only", "threads=1", "--measure", "0.2", "--trial-timeout", "120",
            "-o", str(tmp / "tuned.yaml"), "--json"]
    return tmp, run_yaml, argv, main(argv)


@pytest.mark.slow
def test_tune_writes_a_tune_layer_that_explain_attributes_to_tune(tuned_once, capsys):
    tmp, run_yaml, argv, code = tuned_once
    assert code == 0
    tuned = tmp / "tuned.yaml"
    layer = yaml.safe_load(tuned.read_text())
    assert layer["layer"] == "tune"
    assert layer["training"]["micro_batch_size"] * layer["training"]["gradient_accumulation_steps"] == 8
    assert set(layer) == {"layer", "training", "precision", "model", "parallel", "compile", "data", "launch"}
    assert (tmp / "tuned.png").read_bytes()[:4] == b"\x89PNG"
    resolved = resolve([run_yaml, tuned])
    assert resolved.origins["training.micro_batch_size"].layer == "tune"
    assert resolved.origins["launch.threads_per_process"].layer == "tune"
    assert resolved.origins["optim.lr"].layer == "default"


@pytest.mark.slow
def test_the_cache_answers_without_trials_or_torch_and_never_overwrites(tuned_once, capsys):
    tmp, run_yaml, argv, _ = tuned_once
    script = ("import json, sys; from overdrive.cli import main; code = main(sys.argv[1:]); "
              "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    *result_lines, last = done.stdout.strip().splitlines()
    assert json.loads(last) == {"code": 0, "torch": False}, done.stderr
    result = json.loads("\n".join(result_lines))
    assert result["cache_hit"] is True
    assert result["tuned"].endswith("tuned-2.yaml") and result["chart"].endswith("tuned-2.png")
    assert yaml.safe_load((tmp / "tuned-2.yaml").read_text()) == yaml.safe_load((tmp / "tuned.yaml").read_text())
    assert "tune:" not in done.stderr  # no trial ran
    statuses = {c["status"] for c in result["candidates"]}
    assert "ok" in statuses and statuses <= {"ok", "stopped", "dominated", "pruned", "crashed", "oom", "timeout"}
    # A key that cannot change speed (the learning rate) keeps the fingerprint; the sequence length does not.
    again = subprocess.run([sys.executable, "-c", script, *argv, "lr=1e-4", "--force"], capture_output=True,
                           text=True, timeout=120)
    assert json.loads(again.stdout.strip().splitlines()[-1])["torch"] is False


@pytest.mark.slow
def test_the_table_lists_every_candidate_with_status_speed_and_memory(tuned_once):
    tmp, run_yaml, argv, _ = tuned_once
    from overdrive.tune import cache

    entries = list(cache.directory(resolve([run_yaml]).config).glob("*.json"))
    result = json.loads(entries[0].read_text())
    rows = output.rows(result)
    assert len(rows) == len(result["candidates"])
    assert rows[0][0] == "*" and rows[0][2] == "ok"
    text = output.tuned_yaml(result, "run.yaml")
    assert "global batch 8" in text and "layer: tune" in text
