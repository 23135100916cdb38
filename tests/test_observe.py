"""The pure parts of observe/: step timers, the hang judgment, stragglers, lost machines."""

from __future__ import annotations

import time

from overdrive.observe.heartbeat import Beat, Heartbeat, read_beats
from overdrive.observe.steps import StepRecorder
from overdrive.observe.stragglers import StragglerWatch
from overdrive.observe.watchdog import RankView, judge, lost_machines, render


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_phases_add_up_and_the_wait_after_the_last_gradient_is_not_compute():
    clock = Clock()
    rec = StepRecorder(clock)
    for phase, seconds in (("data", 0.1), ("forward", 0.3), ("backward", 0.5), ("optimizer", 0.1), ("sync", 0.05)):
        rec.enter(phase)
        if phase == "backward":
            clock.now += 0.2
            rec._grad_ready(None)  # the last gradient after 0.2 s; 0.3 s more waiting for the reduction
            clock.now += seconds - 0.2
        else:
            clock.now += seconds
    rec.enter("data")
    rec.step_done(1)
    per = rec.read().per_step()
    assert abs(per["compute_s"] - (0.3 + 0.2 + 0.1)) < 1e-9
    assert abs(per["wait_s"] - (0.1 + 0.05 + 0.3)) < 1e-9
    assert abs(per["compute_s"] + per["wait_s"] - 1.05) < 1e-9
    assert rec.read().steps == 0  # a read starts a new window


def beat(rank, step=10, phase="sync", host="a", written=None, progress=1, grads=None):
    return Beat(rank=rank, local_rank=rank, host=host, pid=100 + rank, step=step, phase=phase, phase_since=0.0,
                progress=progress, written=time.time() if written is None else written, grads_ready_s_ago=grads)


def test_a_hang_names_the_silent_rank_and_the_waiting_one():
    views = [RankView(beat(0, phase="backward", grads=25.0), silent_s=0.5, still_s=25),
             RankView(beat(1, phase="forward"), silent_s=25, still_s=25)]
    hang = judge(views, world_size=2, timeout_s=20)
    assert [v.beat.rank for v in hang.stuck] == [1] and [v.beat.rank for v in hang.waiting] == [0]
    text = render(hang, {0: "Current thread 0x1 (most recent call first):\n  File \"loop.py\", line 9 in _loop\n", 1: ""})
    assert "stuck: rank 1" in text and "(after step 10)" in text and "loop.py" in text
    assert "rank 1 did not answer" in text


def test_no_hang_while_anyone_progresses_or_when_switched_off():
    views = [RankView(beat(0), silent_s=0.5, still_s=25), RankView(beat(1, phase="forward"), silent_s=0.5, still_s=3)]
    assert judge(views, world_size=2, timeout_s=20) is None
    assert judge([RankView(beat(0, phase="finished"), 30, 30)], 1, 20) is None


def test_a_rank_alive_but_not_in_a_collective_is_the_stuck_one():
    views = [RankView(beat(0, phase="sync"), 0.5, 30), RankView(beat(1, phase="forward"), 0.5, 30)]
    assert [v.beat.rank for v in judge(views, 2, 20).stuck] == [1]


def test_a_straggler_is_named_once_it_stays_slower():
    watch = StragglerWatch(["a", "b", "c"], windows=3)
    assert watch.add([0.2, 0.21, 0.4]) is None and watch.add([0.2, 0.2, 0.41]) is None
    named = watch.add([0.2, 0.2, 0.42])
    assert named.rank == 2 and named.host == "c" and named.ratio > 2 and "rank 2" in named.sentence()
    assert watch.add([0.2, 0.2, 0.43]) is None and watch.current().rank == 2  # named once
    watch.add([0.2, 0.2, 0.2])
    assert watch.current() is None


def test_a_machine_whose_every_rank_went_silent_is_lost():
    now = time.time()
    beats = {0: beat(0, host="a", written=now), 1: beat(1, host="b", written=now - 30),
             2: beat(2, host="b", written=now - 31)}
    assert lost_machines(beats, now, after_s=10) == {"b": [1, 2]}
    beats[1] = beat(1, host="b", written=now)
    assert lost_machines(beats, now, after_s=10) == {}


def test_the_live_record_is_current_between_heartbeats(tmp_path):
    rec = StepRecorder()
    with Heartbeat(rec, tmp_path, rank=0, local_rank=0, world_size=1, interval_s=60):
        rec.enter("forward")
        rec.step_done(7)
        rec.enter("backward")
        seen = read_beats(tmp_path)[0]  # the JSON was written once, at the start; the map has the rest
        assert (seen.step, seen.phase) == (7, "backward")
    assert read_beats(tmp_path)[0].phase == "finished"


def test_communication_hidden_behind_compute_is_not_counted():
    from types import SimpleNamespace as NS

    from overdrive.observe.profiling import collective_seconds_by_phase

    def event(name, start, end, thread=1):
        return NS(name=name, thread=thread, time_range=NS(start=start, end=end))

    events = [event("phase:backward", 0, 100), event("phase:forward", 100, 200),
              event("aten::mm", 0, 60), event("gloo:all_reduce", 40, 90, thread=7),  # 20 hidden, 30 exposed
              event("c10d::_allgather_base_", 110, 130), event("aten::addmm", 130, 200)]
    seconds = collective_seconds_by_phase(events)
    assert abs(seconds["backward"] - 30e-6) < 1e-12 and abs(seconds["forward"] - 20e-6) < 1e-12


def rank_record(step_s, **phases):
    full = dict.fromkeys(("data", "forward", "backward", "optimizer", "communication", "other"), 0.0)
    full.update(phases)
    return {"rank": 0, "step_s": step_s, "phases": full, "peak_memory_bytes": 10 * 2**20}


def test_the_verdict_names_the_bottleneck_and_the_key_to_change():
    from overdrive.resolving import load_config
    from overdrive.observe.verdict import judge

    zero3 = load_config(cli=["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"], env={})
    bottleneck, advice = judge(zero3, [rank_record(1.0, forward=0.2, backward=0.2, communication=0.6)], 2**30)
    assert bottleneck == "communication" and (advice[0]["key"], advice[0]["value"]) == ("parallel.deepspeed.zero_stage", 2)
    plain = load_config(cli=[], env={})
    bottleneck, advice = judge(plain, [rank_record(1.0, data=0.5, forward=0.5)], 2**30)
    assert bottleneck == "data" and advice[0]["key"] == "data.num_workers" and advice[0]["value"] >= 1
    bottleneck, advice = judge(plain, [rank_record(1.0, forward=0.5, backward=0.5)], 2**30)
    assert bottleneck == "compute" and advice[0] == {**advice[0], "key": "precision.mixed_precision", "value": "bf16"}
    assert advice[-1]["key"] == "training.micro_batch_size"  # 10 MiB of 1 GiB: room for more
    # A CPU without native bf16 emulates it, slower than fp32: compile is the first advice there.
    _, advice = judge(plain, [rank_record(1.0, forward=0.5, backward=0.5)], 2**30, fast_bf16=False)
    assert [a["key"] for a in advice] == ["compile.backend", "training.micro_batch_size"]
    bottleneck, _ = judge(plain, [{**rank_record(1.0, forward=1.0), "peak_memory_bytes": 0.95 * 2**30}], 2**30)
    assert bottleneck == "memory"
