"""The per-rank panel of `overdrive report`: each rank's compute and waiting per step, and
the straggler the run named (metrics.jsonl fields `rank_compute_s`, `rank_wait_s`,
`rank_host`, `straggler`, written by observe/ at each logging step of a multi-process run)."""

from __future__ import annotations

from statistics import mean
from typing import Any, Optional


def panel(train: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Per-rank means over the logged windows after the first (start-up), and the straggler."""
    logged = [r for r in train if isinstance(r.get("rank_compute_s"), list)]
    if not logged:
        return None
    steady = logged[1:] or logged
    world = len(steady[-1]["rank_compute_s"])
    steady = [r for r in steady if len(r["rank_compute_s"]) == world and len(r.get("rank_wait_s") or []) == world]
    hosts = steady[-1].get("rank_host") or ["?"] * world
    ranks = [{"rank": i, "host": hosts[i] if i < len(hosts) else "?",
              "compute_s": mean(r["rank_compute_s"][i] for r in steady),
              "wait_s": mean(r["rank_wait_s"][i] for r in steady)} for i in range(world)]
    named = [r["straggler"] for r in logged if r.get("straggler") is not None]
    straggler = max(set(named), key=named.count) if named else None
    return {"ranks": ranks, "straggler": straggler, "straggler_logs": named.count(straggler) if named else 0,
            "logs": len(logged)}


def straggler_sentence(p: dict[str, Any]) -> Optional[str]:
    if p["straggler"] is None:
        return None
    r = p["ranks"][p["straggler"]]
    others = [x["compute_s"] for x in p["ranks"] if x["rank"] != r["rank"]]
    ratio = r["compute_s"] / max(mean(others), 1e-12)
    return (f"straggler: rank {r['rank']} (host {r['host']}): compute {r['compute_s']:.3f} s per step, "
            f"{ratio:.2f}x the other ranks' mean; named in {p['straggler_logs']} of {p['logs']} logs")


def markdown(train: list[dict[str, Any]]) -> list[str]:
    p = panel(train)
    if p is None:
        return []
    out = ["", "## Ranks", "", "| rank | host | compute s/step | waiting s/step |", "| --- | --- | --- | --- |"]
    out += [f"| {r['rank']}{' (straggler)' if r['rank'] == p['straggler'] else ''} | {r['host']} | "
            f"{r['compute_s']:.4f} | {r['wait_s']:.4f} |" for r in p["ranks"]]
    sentence = straggler_sentence(p)
    out += ["", sentence if sentence else "No straggler: no rank's compute stayed clearly above the others'."]
    return out
