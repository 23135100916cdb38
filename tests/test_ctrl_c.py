"""Ctrl-C answered at once: the first says which step the run stops after and that it saves,
the second stops without waiting for that checkpoint and says what was kept."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from overdrive.checkpoint.signals import StopRequest


def test_the_first_ctrl_c_is_answered_the_second_says_what_was_kept(capfd):
    with StopRequest(same_press_s=0) as stop:
        stop.answer = lambda signum: f"stopping after step 7, {signal.Signals(signum).name}"
        stop.abandon = lambda: "kept: step 5"
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        assert "stopping after step 7, SIGINT" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert "kept: step 5" in capfd.readouterr().err


def test_a_copy_of_the_same_press_is_not_a_second_ctrl_c():
    # A launched worker gets the terminal's SIGINT and, a moment later, its agent's copy.
    with StopRequest(same_press_s=30) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT


@pytest.mark.slow
@pytest.mark.alone  # answered within 2 s
def test_ctrl_c_on_a_one_process_run_is_answered_within_2s_and_exits_130_with_a_checkpoint(tmp_path):
    from checkpoint_probe import command, kill_group, start, steps_logged, wait_for

    out = tmp_path / "run"
    # Steps long enough that an answer given only at the step's end would be late.
    proc = start(command(out, tmp_path / "cache", "training.max_steps=400", "model.architecture.n_embd=128",
                         "model.architecture.n_layer=2", "data.max_length=64", "training.micro_batch_size=32",
                         "checkpoint.every_steps=1000"), cwd=tmp_path)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), line)) for line in proc.stderr],
                              daemon=True)
    reader.start()
    wait_for(lambda: len(steps_logged(out)) >= 2, proc, what="step 2")
    sent = time.monotonic()
    kill_group(proc, sig=signal.SIGINT)
    proc.wait(timeout=240)  # stderr is the reader's alone
    reader.join(timeout=10)
    answers = [(at, line) for at, line in lines if "stopping after step" in line]
    assert answers, "".join(line for _, line in lines)[-3000:]
    answered_at, answer = answers[0]
    assert answered_at - sent < 2.0, answered_at - sent
    assert "Ctrl-C again to stop now without a checkpoint" in answer
    assert proc.returncode == 130, "".join(line for _, line in lines)[-3000:]
    stopped = max(steps_logged(out))
    assert f"stopping after step {stopped} and saving" in answer
    assert (out / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    # Before the first step, each stage was said as it began (nothing silent for long).
    said = "".join(line for _, line in lines)
    for stage in ("loading torch", "reading the tokenizer and the data", "building the model", "preparing the model"):
        assert stage in said, said[-3000:]
