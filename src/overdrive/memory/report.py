"""Verdicts against this machine's memory, and the estimate as a table, JSON or a PNG."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from overdrive.memory import Estimate, Row
from overdrive.memory.formulas import FIELDS
from overdrive.memory.shape import numel

from overdrive.console import counted

GIB = 2**30
HEADROOM = 0.10
"""Kept free: allocator fragmentation, the CUDA context (~0.5-1 GiB), NCCL buffers and the
kernels' workspaces are not in the formulas."""


@dataclass(frozen=True)
class Capacity:
    """Memory a strategy must fit in: per device, and host RAM shared by a node's processes."""

    device_bytes: int
    host_bytes: int
    kind: str  # "gpu" or "host": with no GPU the processes train in host RAM
    source: str


def detect_capacity(gpu_memory_gib: Optional[float] = None, host_memory_gib: Optional[float] = None) -> Capacity:
    """GPU memory via torch.cuda when a GPU is present (or given), else host RAM: both from
    the machine's one detection (system/hardware.py)."""
    from overdrive.system import hardware

    host = int(host_memory_gib * GIB) if host_memory_gib else hardware.ram_bytes()
    if gpu_memory_gib:
        return Capacity(int(gpu_memory_gib * GIB), host, "gpu", f"{gpu_memory_gib:g} GiB per GPU (given)")
    gpus = hardware.gpus_from_torch()
    if gpus:
        smallest = min(gpus, key=lambda g: g.memory_bytes)
        return Capacity(smallest.memory_bytes, host, "gpu", f"{gpus[0].name}, {smallest.memory_bytes / GIB:.1f} GiB")
    return Capacity(host, host, "host", f"host RAM (no GPU), {host / GIB:.1f} GiB shared by the processes")


def apply_verdict(est: Estimate, cap: Capacity, headroom: float = HEADROOM, nodes: int = 1) -> Optional[Row]:
    """Set `fits` on every row; return the cheapest row that fits (rows are cheapest first)."""
    local = -(-est.setup.devices // max(nodes, 1))
    host_budget = cap.host_bytes * (1 - headroom)
    for row in est.rows:
        if row.refused:  # train would not run it, whatever its memory
            row.fits = False
        elif cap.kind == "host":
            # Training on the CPU: every local process draws on the same RAM.
            row.fits = (row.total_bytes + row.host_bytes) * local <= host_budget
        else:
            row.fits = (row.total_bytes <= cap.device_bytes * (1 - headroom)
                        and row.host_bytes * local <= host_budget)
    return next((row for row in est.rows if row.fits), None)


def to_json(est: Estimate, cap: Optional[Capacity] = None, best: Optional[Row] = None, **extra) -> str:
    s = est.setup
    data = {
        "model": est.shape.name,
        "parameters": est.shape.params,
        "active_parameters": est.shape.active_params,
        "devices": s.devices,
        "precision": s.precision,
        "micro_batch": s.micro_batch,
        "seq_len": s.seq_len,
        "activation_checkpointing": s.checkpointing,
        "target": s.target,
        "layout": {"dp_replicate": s.dp_replicate, "tp": s.tp, "cp": s.cp, "sp": s.sp, "shard_ranks": s.shard_ranks},
        **({"moe": moe_fields(est)} if est.shape.experts else {}),
        **({"vision": vision_fields(est)} if est.shape.parts else {}),
        "rows": [row.to_dict() for row in est.rows],
        "cheapest_fitting": best.strategy if best else None,
    }
    if cap is not None:
        data["capacity"] = {"device_bytes": cap.device_bytes, "host_bytes": cap.host_bytes, "kind": cap.kind,
                            "source": cap.source, "headroom": HEADROOM}
    data.update(extra)
    return json.dumps(data, indent=2)


def vision_fields(est: Estimate) -> dict:
    """A vision-language model: its parts' parameters, which are frozen, and what an image takes of a row."""
    shape, s = est.shape, est.setup
    sizes = {part: 0 for part in ("language", "vision", "projector")}
    for part, dims in zip(shape.parts, shape.param_shapes):
        sizes[part] += numel(dims)
    return {"parameters": sizes, "frozen": list(s.frozen_parts), "image_tokens": s.image_tokens,
            "image_patches": s.image_patches}


def vision_line(est: Estimate) -> str:
    v = vision_fields(est)
    parts = ", ".join(f"{part} {count:,}" for part, count in v["parameters"].items())
    frozen = f"frozen: {' and '.join(v['frozen'])} (weights only)" if v["frozen"] else "every part trains"
    image = (f"an image is {v['image_tokens']:,} of the {est.setup.seq_len:,} tokens of a row" if v["image_tokens"]
             else "image sizes not read for this family")
    return f"vision-language: {parts} parameters; {frozen}; {image}."


def moe_fields(est: Estimate) -> dict:
    """A mixture of experts: its experts, the parameters a token meets, and the experts' weights one
    expert-parallel rank holds."""
    shape, s = est.shape, est.setup
    ep = s.ep
    return {"experts": shape.experts, "top_k": shape.top_k, "expert_parameters": shape.expert_params,
            "active_parameters": shape.active_params, "ep_size": ep,
            "expert_parameters_per_ep_rank": -(-shape.expert_params // ep),
            "all_to_all_bytes_per_micro_batch": all_to_all_bytes(shape, s)}


def all_to_all_bytes(shape, s) -> int:
    """Bytes one rank sends by all-to-all in a micro-batch's forward and backward under expert parallel:
    each of its tokens' top_k (token, expert) pairs whose expert lives elsewhere ((ep - 1) / ep of them
    when the router balances) goes out as a hidden-wide vector and comes back, in the forward (dispatch,
    combine) and again in the backward: 4 x tokens x top_k x hidden x (ep - 1) / ep, per MoE layer (every
    layer counted as one)."""
    if s.ep == 1 or not shape.experts:
        return 0
    tokens = s.micro_batch * s.seq_len
    return round(4 * tokens * shape.top_k * shape.hidden * s.half_bytes * shape.layers * (s.ep - 1) / s.ep)


def _counted_params(shape) -> str:
    if not shape.experts:
        return f"{parameter_count(shape.params)} parameters"
    return (f"{parameter_count(shape.params)} parameters ({parameter_count(shape.active_params)} active: "
            f"{shape.top_k} of {shape.experts} experts per token)")


def parameter_count(params: float) -> str:
    """1.19M, 124M, 7.24B: the unit that keeps the number readable (never 0.00119B)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= scale:
            return f"{params / scale:.3g}{unit}"
    return f"{params:.0f}"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def table_rows(est: Estimate) -> tuple[list[str], list[list[str]]]:
    headers = ["strategy", "params", "grads", "optim", "master", "activ", "activ ckpt", "buffers", "total",
               "host/proc", "fits"]
    rows = []
    for r in est.rows:
        fits = "refused" if r.refused else "-" if r.fits is None else ("yes" if r.fits else "no")
        rows.append([r.strategy, gib(r.params_bytes), gib(r.grads_bytes), gib(r.optimizer_bytes),
                     gib(r.master_weights_bytes), gib(r.activations_full_bytes),
                     gib(r.activations_checkpointed_bytes), gib(r.buffers_bytes), gib(r.total_bytes),
                     gib(r.host_bytes), fits])
    return headers, rows


def render(est: Estimate, cap: Capacity, best: Optional[Row], headroom: float = HEADROOM, file=None) -> None:
    from overdrive.console import print_table

    s, shape = est.setup, est.shape
    title = (f"{shape.name}: {_counted_params(shape)}, {counted(s.devices, 'device')}{_layout(s)}, precision {s.precision}, "
             f"micro-batch {s.micro_batch} x {s.seq_len} tokens — GiB per device")
    headers, rows = table_rows(est)
    print_table(headers, rows, title=title, file=file)
    lines = [
        f"total = params + grads + optim + master + buffers + activations "
        f"({'with' if s.checkpointing else 'without'} activation checkpointing; both shown).",
        f"kernels assumed: {s.target} ({'attention ' + _kernel(est)}); host/proc is host RAM per process.",
        f"capacity: {cap.source}; fits leaves {headroom:.0%} headroom.",
        f"cheapest that fits: {best.strategy} ({best.label})" if best else
        "nothing fits: add devices, lower the micro-batch or sequence length, or turn on checkpointing.",
        *refusal_lines(est),
        *([vision_line(est)] if shape.parts else []),
    ]
    print("\n".join(lines), file=file)


def refusal_lines(est: Estimate) -> list[str]:
    """Each row train would refuse, and why (memory/refusals.py)."""
    return [f"refused: {r.strategy}: {r.refused}" for r in est.rows if r.refused]


def _layout(s) -> str:
    axes = [f"{name} {size}" for name, size in (("dp_replicate", s.dp_replicate), ("tp", s.tp), ("cp", s.cp),
                                                 ("sp", s.sp), ("ep", s.ep)) if size > 1]
    return f" ({' x '.join(axes)}, model states sharded over {s.shard_ranks})" if axes else ""


def _kernel(est: Estimate) -> str:
    from overdrive.memory.activations import attention_kernel

    return attention_kernel(est.shape, est.setup)


COLORS = {"params_bytes": "#4C72B0", "grads_bytes": "#DD8452", "optimizer_bytes": "#55A868",
          "master_weights_bytes": "#C44E52", "activations_bytes": "#8172B3", "buffers_bytes": "#937860"}


def plot(est: Estimate, path: str, cap: Optional[Capacity] = None, headroom: float = HEADROOM) -> None:
    """Stacked bars per strategy (device), host RAM per process as a hatched bar beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy for r in est.rows]
    x = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(names)), 4.8))
    bottom = [0.0] * len(names)
    for field in FIELDS:
        values = [getattr(r, field) / GIB for r in est.rows]
        ax.bar([i - 0.18 for i in x], values, 0.36, bottom=bottom, color=COLORS[field],
               label=field.replace("_bytes", "").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar([i + 0.18 for i in x], [r.host_bytes / GIB for r in est.rows], 0.36, color="white", edgecolor="#555555",
           hatch="//", label="host RAM per process")
    if cap is not None and cap.kind == "gpu":
        ax.axhline(cap.device_bytes * (1 - headroom) / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"device memory less {headroom:.0%}")
    s = est.setup
    ax.set_title(f"{est.shape.name} ({est.shape.params / 1e9:.3g}B) · {s.devices} devices · {s.precision} · "
                 f"micro-batch {s.micro_batch} x {s.seq_len}", fontsize=10)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("GiB per device")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paper_table_markdown(psi: float, devices: int) -> str:
    """The ZeRO paper's model states per device (K = 12 split into master 4 + Adam 8), in GB."""
    from overdrive.memory import zero_paper_bytes

    stages = [zero_paper_bytes(psi, devices, stage) for stage in range(4)]
    n = devices

    def split(stage: int, bytes_per_param: int) -> float:
        return bytes_per_param * psi / (n if stage >= 1 else 1)

    rows = [
        ("Parameters (16-bit)", [s["params"] for s in stages]),
        ("Gradients (16-bit)", [s["grads"] for s in stages]),
        ("fp32 master weights", [split(k, 4) for k in range(4)]),
        ("Adam momentum + variance (fp32)", [split(k, 8) for k in range(4)]),
        ("**Total per GPU**", [s["total"] for s in stages]),
    ]
    lines = ["| component | no ZeRO | ZeRO-1 | ZeRO-2 | ZeRO-3 |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | " + " | ".join(f"{v / 1e9:.1f} GB" for v in values) + " |" for name, values in rows]
    return "\n".join(lines)


def markdown(est: Estimate, cap: Optional[Capacity] = None, best: Optional[Row] = None) -> str:
    """The estimate as a markdown table in GiB (2^30 bytes, as the terminal table), for docs and reports."""
    s = est.setup
    head = ("| strategy | params | grads | optimizer | fp32 master | activations (ckpt) | buffers | total | "
            "host RAM/process | fits |")
    lines = [head, "| --- " * 10 + "|"]
    for r in est.rows:
        fits = "refused" if r.refused else "-" if r.fits is None else ("yes" if r.fits else "no")
        act = f"{r.activations_full_bytes / GIB:.1f} ({r.activations_checkpointed_bytes / GIB:.1f})"
        lines.append(f"| {r.strategy} | " + " | ".join(f"{v / GIB:.1f}" for v in (
            r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.master_weights_bytes)) + f" | {act} | "
            f"{r.buffers_bytes / GIB:.1f} | **{r.total_bytes / GIB:.1f}** | {r.host_bytes / GIB:.1f} | {fits} |")
    notes = [f"{est.shape.params:,} parameters, {counted(s.devices, 'device')}, {s.precision}, micro-batch "
             f"{s.micro_batch} x {s.seq_len} tokens, {s.target} kernels; GiB per device; total uses activations "
             f"{'with' if s.checkpointing else 'without'} checkpointing."]
    if cap is not None:
        notes.append(f"fits: within {cap.source} less {HEADROOM:.0%}"
                     + (f"; cheapest that fits: **{best.strategy}**." if best else "; nothing fits."))
    notes += [f"{line}." for line in refusal_lines(est)]
    return "\n".join(lines) + "\n\n" + " ".join(notes)
