"""Telemetry: FLOPs per token, device peaks, throughput, metrics.jsonl, progress, trackers."""

from __future__ import annotations

import io
import json

import pytest
import torch

from overdrive.training import telemetry
def test_flops_per_token_is_6n_plus_the_attention_term():
    # PaLM appendix B: 6N + 12 * n_layer * n_embd * seq_len.
    assert telemetry.flops_per_token(1_000_000, 4, 256, 512) == 6e6 + 12 * 4 * 256 * 512


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA A10G", 70e12),
    ("Some Future GPU", None),
])
def test_gpu_peaks_match_specific_names_first(name, peak):
    assert telemetry.gpu_peak_flops(name) == peak


def test_cpu_peak_is_cached_and_only_rises(tmp_path, monkeypatch):
    # A measurement under load comes out low: the cache keeps the best one seen.
    results = iter([1.5e11, 1.0e11, 2.0e11, 3.0e11])
    calls = []

    def fake_measure(dtype, *args, **kwargs):
        calls.append((dtype, kwargs.get("sizes")))
        return next(results)

    monkeypatch.setattr(telemetry, "measure_matmul_flops", fake_measure)
    assert telemetry.cpu_peak_flops(torch.float32, tmp_path) == 1.5e11
    assert telemetry.cpu_peak_flops(torch.float32, tmp_path) == 1.5e11  # a lower probe changes nothing
    assert telemetry.cpu_peak_flops(torch.float32, tmp_path) == 2.0e11
    assert calls[0] == (torch.float32, None) and calls[1][1] is not None  # full measurement once, then probes
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [2.0e11]
    # A different dtype is a different peak.
    assert telemetry.cpu_peak_flops(torch.bfloat16, tmp_path) == 3.0e11


def test_measured_matmul_peak_is_plausible():
    flops = telemetry.measure_matmul_flops(torch.float32, sizes=(256,), repeats=2)
    assert 1e8 < flops < 1e14


def test_device_peak_on_cpu_uses_the_compute_dtype(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(telemetry, "measure_matmul_flops", lambda dtype, *a, **k: seen.append(dtype) or 1e11)
    assert telemetry.device_peak_flops(torch.device("cpu"), "bf16", tmp_path) == 1e11
    assert seen == [torch.bfloat16]


def test_peak_memory_on_cpu_is_the_process_rss():
    assert 10 < telemetry.peak_memory_mb(torch.device("cpu")) < 1e6


def test_throughput_counts_tokens_over_the_window():
    now = [100.0]
    meter = telemetry.Throughput(clock=lambda: now[0])
    meter.add(500)
    meter.add(500)
    now[0] = 102.0
    assert meter.read() == pytest.approx(500.0)
    meter.add(300)
    now[0] = 103.0
    assert meter.read() == pytest.approx(300.0)
    assert meter.total_tokens == 1300 and meter.elapsed() == pytest.approx(3.0)


def test_metrics_log_appends_json_lines_on_the_main_process_only(tmp_path):
    log = telemetry.MetricsLog(tmp_path / "run" / "metrics.jsonl")
    log.write({"step": 1, "loss": 2.0})
    log.write({"step": 2, "loss": 1.5})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    silent = telemetry.MetricsLog(tmp_path / "other" / "metrics.jsonl", enabled=False)
    silent.write({"step": 1})
    assert not (tmp_path / "other").exists()


def test_progress_prints_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    progress = telemetry.ProgressDisplay(100, stream=out)
    progress.step(10)
    progress.log(10, {"loss": 3.25, "lr": 1e-3, "tokens_per_s": 12345.0, "mfu": 0.125})
    progress.close()
    line = out.getvalue().strip()
    assert line.startswith("step 10/100") and "loss 3.2500" in line and "12,345 tok/s" in line
    assert "mfu 12.5%" in line and "eta" in line


def test_progress_is_silent_off_the_main_process():
    out = io.StringIO()
    progress = telemetry.ProgressDisplay(10, enabled=False, stream=out)
    progress.log(1, {"loss": 1.0})
    progress.print("hello")
    assert out.getvalue() == ""


def test_trackers_auto_means_tensorboard_when_installed():
    pytest.importorskip("tensorboard")
    assert telemetry.resolve_trackers(["auto"]) == ["tensorboard"]
    assert telemetry.resolve_trackers(["none"]) == []
    assert telemetry.resolve_trackers([]) == []
    assert telemetry.resolve_trackers(["wandb", "wandb"]) == ["wandb"]


def test_flat_config_gives_dotted_scalar_keys():
    flat = telemetry.flat_config({"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "output_dir": "runs/x", "x": None})
    assert flat == {"optim.lr": 1e-3, "optim.betas": "[0.9, 0.95]", "output_dir": "runs/x", "x": "None"}


def test_mfu_remeasures_a_cpu_peak_the_run_outpaces(tmp_path, monkeypatch):
    measurements = iter([1e10, 4e10])  # the first taken under load, the second when the cores are free
    monkeypatch.setattr(telemetry, "measure_matmul_flops", lambda *a, **k: next(measurements))
    peak = telemetry.DevicePeak(torch.device("cpu"), "no", tmp_path)
    assert peak.mfu(5e9) == pytest.approx(0.5)
    assert peak.mfu(2e10) == pytest.approx(0.5)  # faster than the first peak: measured again
    assert peak.flops == 4e10


def test_measuring_the_peak_leaves_the_global_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    telemetry.measure_matmul_flops(sizes=(64,), repeats=1)
    assert torch.equal(torch.rand(4), expected)


def test_the_peak_says_whether_this_run_measured_it_or_an_earlier_run_did(tmp_path, monkeypatch):
    measurements = iter([2e10, 1e10])  # the second run's probe is taken under load: the cache wins
    monkeypatch.setattr(telemetry, "measure_matmul_flops", lambda *a, **k: next(measurements))
    first = telemetry.DevicePeak(torch.device("cpu"), "no", tmp_path)
    assert first.fields() == {"peak_flops": 2e10, "peak_flops_source": "measured"}
    second = telemetry.DevicePeak(torch.device("cpu"), "no", tmp_path)
    assert second.fields() == {"peak_flops": 2e10, "peak_flops_source": "cached"}


def test_loss_tokens_per_second_are_over_the_window_the_last_read_closed():
    now = [100.0]
    meter = telemetry.Throughput(clock=lambda: now[0])
    assert meter.rate_of(10) is None  # no window closed yet
    meter.add(1000)
    now[0] = 104.0
    meter.read()
    assert meter.rate_of(200) == pytest.approx(50.0) and meter.rate_of(None) is None


def test_the_progress_line_says_the_tokens_in_the_loss_when_far_fewer_than_the_input():
    line = telemetry._format({"loss": 1.0, "tokens_per_s": 10000.0, "loss_tokens_per_s": 1200.0})
    assert "10,000 tok/s (1,200 in the loss)" in line
    assert "in the loss" not in telemetry._format({"tokens_per_s": 10000.0, "loss_tokens_per_s": 9990.0})
