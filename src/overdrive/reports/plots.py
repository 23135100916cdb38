"""Pictures of a run for `overdrive report` and `overdrive compare` (matplotlib, Agg).

One overview figure with a panel per recorded quantity, and the same panels as separate
files for pasting one into an issue. A quantity the run did not record gets no panel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.config.schema_eval import is_benchmark_metric
from overdrive.reports.summary import Run, fmt, fmt_bytes, fmt_seconds, series, steady_rate, summarize


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    return plt


def smooth(values: list[float]) -> list[float]:
    """Centred moving average over ~1/25 of the run: shows the trend without the lag of an EMA."""
    half = max(1, len(values) // 50)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


NOISY = 60  # points: above this the raw curve is drawn faint and its trend on top


def _loss(ax, run: Run) -> bool:
    steps, losses = series(run.train, "loss")
    esteps, elosses = series(run.evals, "eval_loss")
    if not losses and not elosses:
        return False
    if losses:
        noisy = len(losses) > NOISY
        ax.plot(steps, losses, color="C0", alpha=0.35 if noisy else 1.0, lw=1, label="train loss",
                marker=None if noisy else "o", ms=3)
        if noisy:  # the raw curve is noisy at small batches: draw the trend on top
            ax.plot(steps, smooth(losses), color="C0", lw=2, label="train loss (moving average)")
    if elosses:
        ax.plot(esteps, elosses, color="C1", marker="s", ms=5, lw=1.5, label="eval loss")
    ax.set_title("Loss")
    ax.set_ylabel("loss (the objective's own)")
    ax.legend(fontsize=8)
    return True


Scale = Callable[[list[float]], tuple[list[float], str]]


def _simple(key: str, title: str, ylabel: str, color: str, scale: Scale | None = None, mean: bool = False,
            from_zero: bool = True):
    def draw(ax, run: Run) -> bool:
        steps, values = series(run.train + (run.evals if key == "memory" else []), key)
        if not values:
            return False
        avg = steady_rate(run.train, key) if mean else None
        label = ylabel
        if scale:  # the mean goes through the same scaling as the points it is drawn with
            scaled, label = scale(values + ([avg] if avg is not None else []))
            values, avg = scaled[: len(values)], (scaled[-1] if avg is not None else None)
        order = sorted(range(len(steps)), key=steps.__getitem__)
        steps, values = [steps[i] for i in order], [values[i] for i in order]
        ax.plot(steps, values, color=color, lw=1.5, marker="o" if len(values) <= NOISY else None, ms=3)
        if avg is not None:
            ax.axhline(avg, color="grey", ls="--", lw=1, label=f"run mean {fmt(avg)}")
            ax.legend(fontsize=8)
        if from_zero:  # amounts, not changes: a zoomed axis would make 2% look like 200%
            ax.set_ylim(bottom=0, top=max(values) * 1.08)
        ax.set_title(title)
        ax.set_ylabel(label)
        return True

    return draw


def _percent(values: list[float]) -> tuple[list[float], str]:
    # MFU is logged as a fraction; a trainer that logs percent already is left alone.
    return ([v * 100 for v in values] if max(values) <= 1 else values), "% of peak FLOPs"


def _memory(values: list[float]) -> tuple[list[float], str]:
    if max(values) >= 2**30:
        return [v / 2**30 for v in values], "GiB"
    return [v / 2**20 for v in values], "MiB"


def _benchmarks(ax, run: Run) -> bool:
    """Every `eval/<task>/<metric>` a run's evaluations wrote (lm-eval's tasks), their stderr left out."""
    names = sorted({k for r in run.evals for k in r if is_benchmark_metric(k) and not k.endswith("_stderr")})
    drawn = False
    for index, name in enumerate(names):
        steps, values = series(run.evals, name)
        if values:
            ax.plot(steps, values, color=f"C{index % 10}", marker="o", ms=4, lw=1.5, label=name[len("eval/"):])
            drawn = True
    if drawn:
        ax.set_title("Benchmarks")
        ax.set_ylabel("score")
        ax.legend(fontsize=8)
    return drawn


PANELS: list[tuple[str, Callable[[Any, Run], bool]]] = [
    ("loss", _loss),
    ("benchmarks", _benchmarks),
    ("lr", _simple("lr", "Learning rate", "lr", "C2", from_zero=False)),
    ("throughput", _simple("tokens_per_s", "Throughput", "tokens/s", "C3", mean=True)),
    ("mfu", _simple("mfu", "Model FLOPs utilisation", "%", "C4", scale=_percent, mean=True)),
    ("memory", _simple("memory", "Peak memory", "bytes", "C5", scale=_memory)),
    # Preference training (TRL's names): drawn only for runs that log them.
    ("preference_accuracy", _simple("rewards/accuracies", "Preference accuracy", "rewards/accuracies", "C6")),
    ("preference_margin", _simple("rewards/margins", "Reward margin", "rewards/margins", "C7", from_zero=False)),
    # Online RL (TRL's GRPO names): the mean reward and how long the completions are.
    ("rl_reward", _simple("reward", "Mean reward", "reward", "C8", from_zero=False)),
    ("rl_completion_length", _simple("completions/mean_length", "Completion length", "tokens", "C9")),
]


def _finish(ax) -> None:
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _summary_text(run: Run) -> str:
    s = summarize(run)
    lines = [f"model: {s['model'] or '-'}", f"strategy: {s['strategy'] or '-'}", f"precision: {s['precision'] or '-'}"]
    if s["global_batch"]:
        lines.append(f"batch: {s['micro_batch_size']} x {s['gradient_accumulation_steps']} x {s['world_size']}"
                     f" = {s['global_batch']}")
    lines += ["", f"final loss: {fmt(s['final_loss'])}", f"min loss: {fmt(s['min_loss'])}",
              f"final eval loss: {fmt(s['final_eval_loss'])}", f"mean tokens/s: {fmt(s['mean_tokens_per_s'])}",
              f"peak memory: {fmt_bytes(s['peak_memory_bytes'])}", f"wall time: {fmt_seconds(s['wall_time_s'])}"]
    return "\n".join(lines)


def plot_run(run: Run, target: Path) -> list[Path]:
    """`report.png` (every panel) and one file per panel. Returns the paths written."""
    plt = _pyplot()
    written: list[Path] = []
    drawn = []
    for name, draw in PANELS:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        if draw(ax, run):
            _finish(ax)
            fig.tight_layout()
            path = target / f"{name}.png"
            fig.savefig(path)
            written.append(path)
            drawn.append(draw)
        plt.close(fig)
    if not drawn:
        return written
    cols = min(3, len(drawn) + 1)  # one cell more than panels: the numbers
    rows = -(-(len(drawn) + 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), dpi=100, squeeze=False)
    cells = [ax for row in axes for ax in row]
    for ax, draw in zip(cells, drawn):
        draw(ax, run)
        _finish(ax)
    for ax in cells[len(drawn):]:
        ax.axis("off")
    if len(cells) > len(drawn):  # a spare cell holds the numbers, so the picture stands alone
        cells[len(drawn)].text(0.02, 0.98, _summary_text(run), va="top", ha="left", family="monospace", fontsize=9,
                               transform=cells[len(drawn)].transAxes)
    fig.suptitle(f"overdrive run: {run.name}", fontsize=13)
    fig.tight_layout()
    overview = target / "report.png"
    fig.savefig(overview)
    plt.close(fig)
    return [overview] + written


def plot_compare(a: Run, b: Run, out: Path, labels: Optional[tuple[str, str]] = None) -> Path:
    """Both runs' train (lines) and eval (markers) loss on one axis."""
    plt = _pyplot()
    labels = labels or (a.name, b.name)
    if labels[0] == labels[1]:
        labels = (str(a.path), str(b.path))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for run, label, color in ((a, labels[0], "C0"), (b, labels[1], "C3")):
        steps, losses = series(run.train, "loss")
        if losses:
            trend = smooth(losses) if len(losses) > NOISY else losses
            ax.plot(steps, trend, color=color, lw=1.8, label=f"{label} train")
        esteps, elosses = series(run.evals, "eval_loss")
        if elosses:
            ax.plot(esteps, elosses, color=color, ls="--", marker="s", ms=5, label=f"{label} eval")
    ax.set_title("Loss: " + " vs ".join(labels))
    ax.set_ylabel("loss (the objective's own)")
    _finish(ax)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
