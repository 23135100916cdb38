"""Train the toy job once per optimizer, one after another, in this one interpreter.

    python tests/optimizer_probe.py --out DIR --processes 1 --micro 8 sgd lion ...
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/optimizer_probe.py \
        --out DIR --processes 2 --micro 4 sgd lion ...

Each optimizer's run is overdrive's own `train()` on a config resolved from the toy overrides
(tests/strategy_probe.py) plus `optim.name=<name>`, writing DIR/<name>/metrics.jsonl. Under
torch.distributed.run every rank runs them all in the same process group: one launch covers
every optimizer (a launch per optimizer would cost the interpreters and the rendezvous each time).
`--set key=value` items apply to every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from strategy_probe import TOY  # noqa: E402

# What each optimizer needs besides its name: schedule-free AdamW replaces the schedule.
EXTRA = {"schedule_free_adamw": ["scheduler.name=constant"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every run")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()

    import torch
    from accelerate.state import PartialState

    from overdrive.resolving import resolve
    from overdrive.training.loop import train

    # train() ends by closing the process group (Accelerator.end_training); the runs after the
    # first would then set up a new one on the agent's store, which hangs. Keep the one group
    # for every run here and close it once at the end.
    PartialState.destroy_process_group = lambda self, group=None: None
    for name in args.names:
        items = [*TOY, f"optim.name={name}", *EXTRA.get(name, []), f"launch.num_processes={args.processes}",
                 f"training.micro_batch_size={args.micro}", f"data.cache_dir={args.cache}",
                 f"output_dir={Path(args.out) / name}", *args.set]
        train(resolve(cli=items, accelerate_default=False))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from overdrive.cli import exit_worker

    exit_worker(0)  # as overdrive's own workers leave: gloo/DeepSpeed's native teardown can abort
