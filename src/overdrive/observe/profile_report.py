"""`overdrive profile`'s report: the ranks' files read back, the verdict, the table.

Pure apart from reading files: the command runs the job (commands/profile.py), each rank
writes `rank<N>.json` (profiling.py), and this module turns them into the `--json`
contract: `{"ranks": [{"rank", "step_s", "phases": {...}, "peak_memory_bytes"}],
"bottleneck", "advice": [{"key", "value", "why", "expected"}], "traces": [paths]}`, with
`mfu`, `tokens_per_s`, `top_ops` and each rank's `host` added.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from overdrive.observe.verdict import judge, shares

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

PHASES = ("data", "forward", "backward", "optimizer", "communication", "other")


def collect(profile_dir: Path) -> list[dict[str, Any]]:
    ranks = [json.loads(p.read_text()) for p in Path(profile_dir).glob("phases.rank*.json")]
    if not ranks:
        from overdrive.errors import UserError

        raise UserError(f"the profiled job wrote no measurements to {profile_dir} (did it run its steps?)")
    return sorted(ranks, key=lambda r: r["rank"])


def traces(profile_dir: Path) -> list[str]:
    found = sorted(Path(profile_dir).glob("trace.rank*.json")) + sorted(Path(profile_dir).glob("tensorboard/*.json"))
    return [str(p) for p in found]


def device_facts(cfg: RunConfig, processes_here: int) -> tuple[Optional[float], bool, bool]:
    """Memory one process may use, whether it is a GPU's, and whether the device multiplies
    bf16 natively."""
    from overdrive.system.hardware import detect

    hw = detect()
    if hw.gpus and not cfg.launch.use_cpu:
        return float(hw.gpus[0].memory_bytes), True, hw.supports_bf16
    return (hw.ram_bytes / max(processes_here, 1)) if hw.ram_bytes else None, False, hw.cpu_bf16_native


def summarise(cfg: RunConfig, ranks: list[dict[str, Any]], profile_dir: Path, cores_per_process: int = 1,
              processes_here: int = 1, mfu: Optional[float] = None) -> dict[str, Any]:
    capacity, cuda, fast_bf16 = device_facts(cfg, processes_here)
    bottleneck, advice = judge(cfg, ranks, capacity, cores_per_process, cuda, fast_bf16)
    from overdrive.config import batch

    # Each data-parallel replica's tokens once: the ranks of a tensor/context-parallel group share theirs.
    tokens_per_step = batch.split(cfg).global_batch * cfg.data.max_length
    slowest = max(r["step_s"] for r in ranks)
    return {
        "ranks": [{"rank": r["rank"], "host": r["host"], "step_s": r["step_s"],
                   "phases": {p: r["phases"][p] for p in PHASES}, "peak_memory_bytes": r["peak_memory_bytes"]}
                  for r in ranks],
        "bottleneck": bottleneck, "advice": advice, "traces": traces(profile_dir),
        "shares": shares(ranks), "mfu": mfu, "tokens_per_s": tokens_per_step / max(slowest, 1e-12),
        "capacity_bytes": capacity, "top_ops": ranks[0].get("top_ops", []),
    }


def render(report: dict[str, Any]) -> str:
    lines = ["per optimizer step, per rank (seconds, share of the step):"]
    header = f"  {'rank':>4} {'step':>8} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'peak memory':>12}"
    lines.append(header)
    for r in report["ranks"]:
        cells = " ".join(f"{r['phases'][p]:>8.4f} ({r['phases'][p] / max(r['step_s'], 1e-12):>4.0%})" for p in PHASES)
        lines.append(f"  {r['rank']:>4} {r['step_s']:>8.4f} {cells} {r['peak_memory_bytes'] / 2**20:>9.0f} MiB")
    mfu = report.get("mfu")
    lines.append(f"throughput: {report['tokens_per_s']:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu is not None else ""))
    if report.get("top_ops"):
        lines.append("top operators (rank 0, self time per step):")
        lines += [f"  {op['self_s_per_step'] * 1e3:>9.2f} ms  {op['calls_per_step']:>6.0f} calls  {op['name']}"
                  for op in report["top_ops"]]
    lines.append(f"bottleneck: {report['bottleneck']}")
    for i, a in enumerate(report["advice"], 1):
        lines.append(f"  {i}. {a['key']}={json.dumps(a['value'])}: {a['why']}; expected: {a['expected']}")
    if not report["advice"]:
        lines.append("  no change to suggest from this measurement")
    tried = report.get("try")
    if tried and tried.get("key"):
        b, a = tried["before"], tried["after"]
        lines.append(f"tried {tried['key']}={json.dumps(tried['value'])}: {b['tokens_per_s']:,.0f} -> "
                     f"{a['tokens_per_s']:,.0f} tokens/s ({tried['speedup']:.2f}x), step {b['step_s']:.4f} -> "
                     f"{a['step_s']:.4f} s, bottleneck {b['bottleneck']} -> {a['bottleneck']}")
    lines.append("traces (open in https://ui.perfetto.dev or TensorBoard's profiler):")
    lines += [f"  {path}" for path in report["traces"]]
    return "\n".join(lines)
