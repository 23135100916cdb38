"""What a finished run's directory holds, as the end-of-run summary lists it: every file and
folder the run wrote there (its trackers' and its heartbeats' too), each said in a few words."""

from __future__ import annotations

from pathlib import Path

from overdrive.config.schema import RunConfig

KNOWN = {
    "metrics.jsonl": "", "resolved.json": "", "checkpoints": "resumable checkpoints",
    "observe": "each rank's heartbeat and stacks", "report": "overdrive report's plots",
    "merged": "save_pretrained", "launch": "the Accelerate and DeepSpeed files the script ran with",
    "wandb": "the tracker's logs", "mlruns": "the tracker's logs",
}


def _about(cfg: RunConfig, entry: Path) -> str:
    if entry.name == "model":
        return "save_pretrained" if cfg.peft.method == "none" else "the adapter: PEFT's directory"
    if entry.is_dir() and entry.name == cfg.logging.project_name:
        return "the tracker's logs"
    return KNOWN.get(entry.name, "")


def listing(cfg: RunConfig, out: Path) -> str:
    """`metrics.jsonl, resolved.json, model/ (save_pretrained), observe/ (...)`: what is in `out`,
    the lock and other hidden files left out."""
    try:
        entries = sorted((p for p in Path(out).iterdir() if not p.name.startswith(".")),
                         key=lambda p: (p.name not in ("metrics.jsonl", "resolved.json"), p.is_dir(), p.name))
    except OSError:
        return "metrics.jsonl, resolved.json"
    said = []
    for entry in entries:
        about = _about(cfg, entry)
        said.append(entry.name + ("/" if entry.is_dir() else "") + (f" ({about})" if about else ""))
    return ", ".join(said)
