"""`overdrive preflight`: rank 0's judgment of what every rank sent, and the table printed.

Pure (no torch): the worker side (preflight.py) measures and gathers; this module compares
and words. A problem names the key or the machine to fix and makes the command exit 2.
"""

from __future__ import annotations

from overdrive.console import counted

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# Before training there is no step time to set the traffic against, so the table gives the
# seconds per optimizer step the traffic costs at the measured bandwidth.
MiB = 2**20


def _mb(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _rate(n: float) -> str:
    return f"{n / 1e9:.2f} GB/s" if n >= 1e8 else f"{n / 1e6:.1f} MB/s"


def _problem(key: str, message: str, fix: str) -> dict[str, str]:
    return {"key": key, "message": message, "fix": fix}


def _differences(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    keys = sorted(set(base) | set(other))
    return [k for k in keys if base.get(k) != other.get(k)]


def judge(cfg: RunConfig, ranks: list[dict[str, Any]], comm: Optional[dict[str, float]], rendezvous_s: float, params: int,
          traffic_bytes: float, checkpoint_bytes: int) -> dict[str, Any]:
    rows: list[list[str]] = []
    problems: list[dict[str, str]] = []
    first = ranks[0]
    hosts = sorted({(r["machine"], r["host"]) for r in ranks})
    rows.append(["rendezvous", f"{counted(len(ranks), 'process')} on {counted(len(hosts), 'machine')} in {rendezvous_s:.1f} s", "ok"])
    if comm:
        rows.append(["all-reduce", f"{_mb(comm['bucket_bytes'])} bucket in {comm['all_reduce_s'] * 1e3:.1f} ms: "
                     f"bus bandwidth {_rate(comm['all_reduce_busbw'])}", "ok"])
        rows.append(["all-gather", f"{_mb(comm['bucket_bytes'])} in {comm['all_gather_s'] * 1e3:.1f} ms: "
                     f"bus bandwidth {_rate(comm['all_gather_busbw'])}", "ok"])
        rows.append(["latency", f"8-byte all-reduce {comm['latency_s'] * 1e6:.0f} us", "ok"])
        per_step = traffic_bytes / max(comm["all_reduce_busbw"], 1.0)
        rows.append(["step traffic", f"{params / 1e6:.1f}M parameters: {_mb(traffic_bytes)} per rank per optimizer "
                     f"step, about {per_step:.3f} s at the measured bandwidth (hidden behind backward where the "
                     "strategy overlaps it)", "ok"])
    else:
        rows.append(["collectives", "one process: nothing to measure", "-"])
    blind = [r for r in ranks if not r["sees_output_dir"]]
    if blind:
        where = ", ".join(sorted({f"machine {r['machine']} ({r['host']})" for r in blind}))
        problems.append(_problem("output_dir", f"{cfg.output_dir} is not shared: {where} cannot read the token rank 0 "
                                 "wrote there", "use a directory every machine mounts (checkpoints are written "
                                 "and read there by all ranks)"))
        rows.append(["output_dir shared", f"not seen by {where}", "FAIL"])
    else:
        rows.append(["output_dir shared", f"{cfg.output_dir}: every rank read rank 0's token", "ok"])
    low = [r for r in ranks if r["free_bytes"] < checkpoint_bytes]
    least = min(r["free_bytes"] for r in ranks)
    if low:
        where = ", ".join(sorted({f"machine {r['machine']} ({r['host']})" for r in low}))
        problems.append(_problem("output_dir", f"{_mb(least)} free where a checkpoint needs about "
                                 f"{_mb(checkpoint_bytes)} ({where})", "free disk space or point output_dir elsewhere"))
        rows.append(["free disk", f"{_mb(least)} < {_mb(checkpoint_bytes)} per checkpoint", "FAIL"])
    else:
        rows.append(["free disk", f"{_mb(least)} free, about {_mb(checkpoint_bytes)} per checkpoint", "ok"])
    version_diffs, config_diffs = [], []
    for r in ranks[1:]:
        for name in _differences(first["versions"], r["versions"]):
            version_diffs.append(f"{name} {first['versions'].get(name)} on machine {first['machine']} "
                                 f"({first['host']}) but {r['versions'].get(name)} on machine {r['machine']} ({r['host']})")
        for key in _differences(first["config"], r["config"]):
            config_diffs.append((key, f"{key}={first['config'].get(key)!r} on machine {first['machine']} but "
                                 f"{r['config'].get(key)!r} on machine {r['machine']} ({r['host']})"))
    version_diffs = sorted(set(version_diffs))
    if version_diffs:
        problems.append(_problem("", "library versions differ: " + "; ".join(version_diffs),
                                 "install the same versions on every machine"))
    rows.append(["versions", ", ".join(f"{k} {v}" for k, v in first["versions"].items()),
                 "FAIL" if version_diffs else "ok"])
    seen: dict[str, str] = {}
    for key, text in config_diffs:
        seen.setdefault(key, text)
    for key, text in seen.items():
        problems.append(_problem(key, f"the machines resolved different configs: {text}",
                                 "give every machine the same config files and key=value items"))
    rows.append(["same config", f"{len(first['config'])} keys compared" + (f"; {len(seen)} differ" if seen else ""),
                 "FAIL" if seen else "ok"])
    return {"rows": rows, "problems": problems, "comm": comm, "params": params, "traffic_bytes": traffic_bytes}


def render(verdict: dict[str, Any]) -> str:
    width = max(len(r[0]) for r in verdict["rows"])
    lines = ["preflight:"] + [f"  {name:<{width}}  {status:<4}  {text}" for name, text, status in verdict["rows"]]
    return "\n".join(lines)
