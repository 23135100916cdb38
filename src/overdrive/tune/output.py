"""What `overdrive tune` leaves behind: tuned.yaml, the table of candidates, a chart.

tuned.yaml is a config layer: `layer: tune` and the chosen keys in the schema's sections.
Given after the user's own files (`overdrive train run.yaml tuned.yaml`), its values win and
`overdrive explain` shows `tune` as their origin. An existing file is never overwritten
unless asked: the result goes to the next free name instead.
"""

from __future__ import annotations

from overdrive.console import counted

import shutil
from pathlib import Path
from typing import Any, Optional

import yaml

from overdrive.config.keys import unflatten as nest  # tuned.yaml writes the schema's sections

STATUS_ORDER = ("ok", "stopped", "crashed", "oom", "timeout", "skipped", "dominated", "pruned")

def free_path(path: Path, force: bool) -> Path:
    """`path`, or when it exists (and not `force`) the first free `stem-N.suffix` beside it."""
    if force or not path.exists():
        return path
    n = 2
    while (candidate := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return candidate


def _fmt(value: Optional[float], unit: str = "") -> str:
    return "-" if value is None else f"{value:,.0f}{unit}"


def by_label(result: dict[str, Any], label: Optional[str]) -> Optional[dict[str, Any]]:
    return next((c for c in result["candidates"] if c["label"] == label), None)


def tuned_yaml(result: dict[str, Any], sources: str, name: str = "tuned.yaml") -> str:
    chosen, base = by_label(result, result["chosen"]), by_label(result, result["baseline"])
    head = [
        f"# overdrive tune: the fastest configuration measured on this machine for: {sources or '(embedded default)'}",
        f"# chosen   {chosen['label']}: {_fmt(chosen['run_tokens_per_s'])} tokens/s over the run "
        f"({_fmt(chosen['tokens_per_s'])} steady)",
    ]
    if base and base.get("run_tokens_per_s"):
        head.append(f"# as given {base['label']}: {_fmt(base['run_tokens_per_s'])} tokens/s "
                    f"-> {chosen['run_tokens_per_s'] / base['run_tokens_per_s']:.2f}x")
    head += [
        f"# global batch {result['global_batch']} over {counted(result['world'], 'process')}, unchanged: the same training, faster",
        f"# {result['measured']} of {len(result['candidates'])} candidates measured in {result['search_s']:.0f} s "
        f"(fingerprint {result['fingerprint']})",
        f"# use it after your own config: overdrive train {sources + ' ' if sources else ''}{name}",
        "",
    ]
    body = yaml.safe_dump({"layer": "tune", **nest(chosen["overrides"])}, sort_keys=False, default_flow_style=False)
    return "\n".join(head) + body


def write_tuned(result: dict[str, Any], path: Path, force: bool, sources: str) -> Path:
    target = free_path(path, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(tuned_yaml(result, sources, str(target)))
    return target


def rows(result: dict[str, Any]) -> list[list[Any]]:
    def order(c: dict[str, Any]) -> tuple:
        return (STATUS_ORDER.index(c["status"]) if c["status"] in STATUS_ORDER else 99, -(c["run_tokens_per_s"] or 0))

    out = []
    for c in sorted(result["candidates"], key=order):
        mark = "*" if c["label"] == result["chosen"] else ("=" if c["label"] == result["baseline"] else "")
        gib = c.get("estimate_bytes")
        out.append([mark, c["label"], c["status"], _fmt(c["tokens_per_s"]), _fmt(c["run_tokens_per_s"]),
                    "-" if c["overhead_s"] is None else f"{c['overhead_s']:.1f}", c["timed_steps"] or "-",
                    _fmt(c["peak_memory_mb"]), "-" if gib is None else f"{gib / 2**30:.2f}", c["stage"], c["reason"]])
    return out


HEADERS = ["", "candidate", "status", "tokens/s", "run tokens/s", "warm-up s", "steps", "peak MB", "est GiB",
           "stage", "note"]


def print_table(result: dict[str, Any], file=None) -> None:
    from overdrive.console import print_table as show

    title = (f"tune: {len(result['candidates'])} candidates, {result['measured']} measured, global batch "
             f"{result['global_batch']}, * chosen, = as given; run tokens/s counts warm-up/compile over "
             f"{result['run_steps']} steps")
    show(HEADERS, rows(result), title=title, file=file)


def chart(result: dict[str, Any], target: Path, cached: Optional[Path] = None) -> Path:
    """A PNG of every candidate's speed; a cached one is copied (no matplotlib needed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if cached is not None and cached.is_file():
        shutil.copyfile(cached, target)
        return target
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_ = sorted(result["candidates"], key=lambda c: c["run_tokens_per_s"] or 0)
    colours = {"ok": "#2b7bba", "stopped": "#9ecae1"}
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.28 * len(rows_) + 1)))
    for i, c in enumerate(rows_):
        value = c["run_tokens_per_s"] or 0
        colour = "#e6550d" if c["label"] == result["chosen"] else colours.get(c["status"], "#bdbdbd")
        ax.barh(i, value, color=colour, edgecolor="black" if c["label"] == result["baseline"] else colour)
        text = c["status"] if c["status"] != "ok" else ""
        if c["label"] == result["baseline"]:
            text = (text + " (as given)").strip()
        if text:
            ax.text(value, i, f" {text}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows_)))
    ax.set_yticklabels([c["label"] for c in rows_], fontsize=7)
    ax.set_xlabel(f"tokens/s over a {result['run_steps']}-step run (warm-up and compile included)")
    ax.set_title(f"overdrive tune: orange = chosen, dark = measured in full, light = stopped early; "
                 f"global batch {result['global_batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
