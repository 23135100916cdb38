"""`overdrive report` and `overdrive compare`: what a finished run did, as plots and markdown.

Reads `<run>/metrics.jsonl` (one JSON object per line: train lines carry `loss`, eval lines
`eval_loss`) and, when present, `<run>/resolved.json` (`{"config": {...}, "origins": {...}}`),
its config read back as a RunConfig (config/stored.py: a key an older run did not write gets its
default; a config that cannot be read is an error naming the file). Every metrics field is
optional: a run from an older trainer, a CPU run without MFU or a run killed half-way still
gets a report of whatever it recorded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from overdrive.config.schema import RunConfig
from overdrive.config.schema_eval import is_benchmark_metric
from overdrive.config.keys import flatten
from overdrive.config.stored import read_stored
from overdrive.errors import UserError
from overdrive.reports import ranks
from overdrive.training import metrics as metrics_file

# Peak memory has been logged under several names and units; all are read, in bytes.
_MEMORY_KEY = re.compile(r"^(peak|max)_mem(ory)?(_allocated|_reserved)?(_(?P<unit>bytes|b|kb|kib|mb|mib|gb|gib))?$")
_UNIT = {None: 1, "bytes": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}


@dataclass
class Run:
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    config: Optional[RunConfig] = None  # None: no resolved.json
    origins: dict[str, str] = field(default_factory=dict)
    bad_lines: int = 0

    @property
    def name(self) -> str:
        return self.path.resolve().name

    def values(self) -> dict[str, Any]:
        """{dotted key: value} of the run's config, as its origins name them ({} without one)."""
        return flatten(self.config.model_dump(mode="json")) if self.config is not None else {}


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) or math.isinf(value) else float(value)


def memory_bytes(record: dict[str, Any]) -> Optional[float]:
    for key, value in record.items():
        match = _MEMORY_KEY.match(key)
        if match and _number(value) is not None:
            return float(value) * _UNIT[match.group("unit")]
    return None


def load_run(path: str | Path) -> Run:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    metrics = metrics_file.path_in(run_dir)
    if not metrics.is_file():
        raise UserError(f"{metrics}: no metrics in this run directory (is it the run's output_dir?)")
    run = Run(run_dir)
    logged = metrics_file.read(metrics)
    run.bad_lines = logged.bad_lines
    for record in logged.records:
        evaluated = _number(record.get("eval_loss")) is not None or any(is_benchmark_metric(k) for k in record)
        if evaluated:
            run.evals.append(record)
        if _number(record.get("loss")) is not None or (
            "eval_loss" not in record and not evaluated and _number(record.get("step")) is not None
        ):
            run.train.append(record)
    if not run.train and not run.evals:
        raise UserError(f"{metrics}: no train or eval lines (every line needs a `loss` or `eval_loss`)")
    resolved = run_dir / "resolved.json"
    if resolved.is_file():
        try:
            data = json.loads(resolved.read_text())
        except ValueError as error:
            raise UserError(f"{resolved}: not valid JSON ({error})") from None
        if isinstance(data, dict):
            from overdrive.config.redact import redact, redact_text

            # Runs written before secrets were masked in resolved.json: masked on the way in.
            stored = data if "config" in data else {"config": data}  # a bare config, written by hand
            run.config = read_stored({**stored, "config": redact(stored["config"])}, str(resolved))
            origins = data["origins"] if isinstance(data.get("origins"), dict) else {}
            run.origins = {k: redact_text(str(v)) for k, v in origins.items()}
    return run


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that have both a step and a finite `key`."""
    steps, values = [], []
    for index, record in enumerate(records):
        value = memory_bytes(record) if key == "memory" else _number(record.get(key))
        if value is None:
            continue
        step = _number(record.get("step"))
        steps.append(step if step is not None else float(index))
        values.append(value)
    return steps, values


def _last(records: list[dict[str, Any]], key: str) -> Any:
    for record in reversed(records):
        if record.get(key) is not None:
            return record[key]
    return None


def steady_rate(records: list[dict[str, Any]], key: str) -> Optional[float]:
    """Mean of a rate (tokens/s, MFU) over the run, weighted by the work in each window.

    Each logged rate covers a window of tokens; the run's rate is total tokens over total
    time, i.e. the harmonic mean weighted by tokens (an arithmetic mean would let one fast
    window outweigh a slow one). Windows' tokens come from the cumulative `tokens` field
    when logged, else are taken as equal. The first window includes start-up and
    torch.compile, so it is left out when there are three or more.
    """
    points: list[tuple[float, Optional[float]]] = []
    previous: Optional[float] = None
    for record in records:
        rate, tokens = _number(record.get(key)), _number(record.get("tokens"))
        weight = tokens - previous if tokens is not None and previous is not None else None
        previous = tokens if tokens is not None else previous
        if rate is not None and rate > 0:
            points.append((rate, weight))
    if len(points) >= 3:
        points = points[1:]
    if not points:
        return None
    weights = [w if w is not None and w > 0 else 1.0 for _, w in points]
    if any(w is None for _, w in points):  # mixed information: equal windows is the honest guess
        weights = [1.0] * len(points)
    return sum(weights) / sum(w / r for (r, _), w in zip(points, weights))


def _data_parallel(cfg: Optional[RunConfig], world: Any) -> Any:
    """The data-parallel degree of the run's config (config/batch.py's one answer), else the world."""
    from overdrive.config.batch import data_parallel_degree

    if not isinstance(world, int) or cfg is None:
        return world
    launch = cfg.launch.model_copy(update={"num_processes": world})
    return data_parallel_degree(cfg.model_copy(update={"launch": launch}))


def summarize(run: Run) -> dict[str, Any]:
    """The run's numbers and config highlights, as plain values (None when not recorded)."""
    from overdrive.config.batch import of as batch_of

    cfg, train, evals = run.config, run.train, run.evals
    _, losses = series(train, "loss")
    loss_steps, _ = series(train, "loss")
    _, eval_losses = series(evals, "eval_loss")
    _, memory = series(train + evals, "memory")
    elapsed = [v for r in train + evals if (v := _number(r.get("elapsed_s"))) is not None]
    stamps = [v for r in train + evals if (v := _number(r.get("time", r.get("timestamp")))) is not None]
    t = cfg.training if cfg is not None else None
    micro: Any = t.micro_batch_size if t is not None else None
    if micro in (None, "auto"):
        micro = _last(train, "micro_batch_size") or micro
    accum = (t.gradient_accumulation_steps if t is not None else None) or _last(train, "gradient_accumulation_steps")
    world = (_last(train, "world_size") or _last(train, "num_processes")
             or (cfg.launch.num_processes if cfg is not None else None))
    data_parallel = _data_parallel(cfg, world)
    min_index = min(range(len(losses)), key=losses.__getitem__) if losses else None
    return {
        "run": str(run.path),
        "model": _model_name(cfg),
        "strategy": _strategy(cfg),
        "precision": (cfg.precision.mixed_precision if cfg is not None else None) or _last(train, "mixed_precision"),
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "world_size": world,
        "data_parallel": data_parallel,  # world / (tp x cp x sp): the ranks that take different samples
        "global_batch": (batch_of(micro, accum, data_parallel).global_batch  # config/batch.py multiplies
                         if all(isinstance(v, int) for v in (micro, accum, data_parallel)) else None),
        "seq_len": _last(train, "seq_len") or (cfg.data.max_length if cfg is not None else None),
        "lr": cfg.optim.lr if cfg is not None else None,
        "scheduler": cfg.scheduler.name if cfg is not None else None,
        "steps": max(loss_steps) if loss_steps else _last(evals, "step"),
        "max_steps": t.max_steps if t is not None else None,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "min_loss": losses[min_index] if min_index is not None else None,
        "min_loss_step": loss_steps[min_index] if min_index is not None else None,
        "final_eval_loss": eval_losses[-1] if eval_losses else None,
        "min_eval_loss": min(eval_losses) if eval_losses else None,
        "final_eval_accuracy": _number(_last(evals, "eval_accuracy")),
        **_preference(train, evals),
        "mean_tokens_per_s": steady_rate(train, "tokens_per_s"),
        "mean_mfu": steady_rate(train, "mfu"),
        "peak_memory_bytes": max(memory) if memory else None,
        "wall_time_s": max(elapsed) if elapsed else (max(stamps) - min(stamps) if len(stamps) > 1 else None),
        "bad_lines": run.bad_lines,
        # The last value of each benchmark metric (eval.tasks), its stderr left out.
        "benchmarks": {k: v for k in sorted({k for r in evals for k in r if is_benchmark_metric(k)})
                       if not k.endswith("_stderr") and (v := _number(_last(evals, k))) is not None},
    }


def _preference(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """The objective's own last logged values beside the loss, train and eval: a preference run's rewards,
    margins, accuracies (and KTO's KL), an RL run's reward, distillation's divergence and agreement."""
    out: dict[str, Optional[float]] = {}
    for name in metrics_file.OBJECTIVE_REPORTED:
        out[f"final_{name}"] = _number(next((r[name] for r in reversed(train) if name in r), None))
        out[f"final_eval_{name}"] = _number(next((r[f"eval_{name}"] for r in reversed(evals) if f"eval_{name}" in r),
                                                 None))
    return out


def _model_name(cfg: Optional[RunConfig]) -> Optional[str]:
    if cfg is None:
        return None
    if cfg.model.name_or_path:
        return cfg.model.name_or_path
    arch = cfg.model.architecture
    if arch:
        shape = f", {arch['n_layer']} layers x {arch['n_embd']} wide" if "n_layer" in arch and "n_embd" in arch else ""
        return f"{arch.get('model_type', 'model')}{shape}, from scratch"
    return None


def _strategy(cfg: Optional[RunConfig]) -> Optional[str]:
    from overdrive.strategies import registry

    return registry.of(cfg).label(cfg) if cfg is not None else None


# ---------------------------------------------------------------- formatting


def fmt_bytes(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def fmt_seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    value = int(round(value))
    return f"{value // 3600}:{value % 3600 // 60:02d}:{value % 60:02d}" if value >= 60 else f"{value} s"


def fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return fmt_bytes(value)
    if kind == "seconds":
        return fmt_seconds(value)
    if kind == "percent":
        return f"{value * 100:.1f}%" if value <= 1 else f"{value:.1f}%"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


# (summary key, label, kind) for the numbers every report and comparison shows.
METRICS = (
    ("first_loss", "first loss", ""),
    ("final_loss", "final loss", ""),
    ("min_loss", "min loss", ""),
    ("final_eval_loss", "final eval loss", ""),
    ("min_eval_loss", "min eval loss", ""),
    ("final_eval_accuracy", "final eval accuracy", ""),
    *((f"final_{prefix}{name}", f"final {prefix.replace('_', ' ')}{name}", "") for prefix in ("", "eval_")
      for name in metrics_file.OBJECTIVE_REPORTED),
    ("mean_tokens_per_s", "mean tokens/s", ""),
    ("mean_mfu", "mean MFU", "percent"),
    ("peak_memory_bytes", "peak memory", "bytes"),
    ("wall_time_s", "wall time", "seconds"),
    ("steps", "steps", ""),
)


def summary_markdown(run: Run, summary: dict[str, Any], images: list[Path]) -> str:
    s = summary
    batch = "-"
    if s["global_batch"]:
        batch = (f"{s['micro_batch_size']} x {s['gradient_accumulation_steps']} x {s['data_parallel']}"
                 f" = {s['global_batch']}")
        if isinstance(s["seq_len"], int):
            batch += f" sequences ({s['global_batch'] * s['seq_len']:,} tokens) per step"
    lr = fmt(s["lr"]) + (f" ({s['scheduler']})" if s["scheduler"] else "")
    out = [f"# Run report: {run.name}", "", f"`{run.path}`", "", "## Config", "", "| | |", "| --- | --- |"]
    for label, value in (("model", s["model"]), ("strategy", s["strategy"]), ("precision", s["precision"]),
                         ("micro-batch x accum x data-parallel", batch), ("sequence length", s["seq_len"]),
                         ("learning rate", lr), ("max steps", s["max_steps"])):
        out.append(f"| {label} | {fmt(value)} |")
    explicit = {k: v for k, v in run.origins.items() if not v.startswith("default")}
    if explicit:
        out += ["", "Set explicitly (everything else is a schema default):", ""]
        values = run.values()  # keyed as the origins are: by dotted name
        out += [f"- `{k}` = `{values.get(k)}` from {v}" for k, v in sorted(explicit.items())[:40]]
        if len(explicit) > 40:
            out.append(f"- ... and {len(explicit) - 40} more (see resolved.json)")
    if run.config is None:
        out += ["", "No resolved.json in the run directory: config values come from metrics.jsonl only."]
    out += ["", "## Results", "", "| | |", "| --- | --- |"]
    for key, label, kind in METRICS:
        if key == "min_loss" and s[key] is not None:
            out.append(f"| {label} | {fmt(s[key])} (step {fmt(s['min_loss_step'])}) |")
        elif s[key] is not None:
            out.append(f"| {label} | {fmt(s[key], kind)} |")
    for name, value in s.get("benchmarks", {}).items():
        out.append(f"| final `{name}` | {fmt(value)} |")
    if s["mean_tokens_per_s"] is not None or s["mean_mfu"] is not None:
        out += ["", "Mean tokens/s and MFU are total tokens over total time of the logged windows, leaving out the "
                "first (start-up, compilation) when there are three or more."]
    out += ranks.markdown(run.train)
    if run.bad_lines:
        out += ["", f"{run.bad_lines} line(s) of metrics.jsonl could not be read and were skipped."]
    if images:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(out) + "\n"


def config_differences(a: Run, b: Run) -> list[tuple[str, Any, Any]]:
    fa, fb = a.values(), b.values()
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def metric_rows(sa: dict[str, Any], sb: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for key, label, kind in METRICS:
        va, vb = sa[key], sb[key]
        if va is None and vb is None:
            continue
        change = "-"
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
            change = f"{(vb - va) / abs(va) * 100:+.1f}%"
        rows.append((label, fmt(va, kind), fmt(vb, kind), change))
    return rows
