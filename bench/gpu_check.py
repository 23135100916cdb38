"""What one GPU can show of the GPU paths, in one command and one table.

    python bench/gpu_check.py                  # every row; on a machine without CUDA, the CPU rows
    python bench/gpu_check.py --only qlora,phases
    python bench/gpu_check.py --out /tmp/check  # keep the runs' output directories

Each row runs `overdrive train` (or `overdrive profile`, `overdrive plan`) as a user types it, on
models and data made here with save_pretrained (no network), and judges what the run wrote:

    qlora          QLoRA under FSDP2 (world 1, bf16) against QLoRA in one plain process (the
                   first 10 losses within bf16's precision: 4 x eps x |loss| x sqrt(step),
                   gpu_check_rows.within_precision), and against LoRA
    fp16_weights   fp16 mixed precision on fp16-loaded weights, 20 steps
    fp16_overflow  an fp16 run whose loss scale overflows at the start: the skips counted, the
                   learning-rate schedule not advanced on them
    memory         the estimate (`overdrive plan --json`) against torch.cuda.max_memory_allocated
                   for one process, ZeRO-2, ZeRO-3 and FSDP2 at world 1 on a 134M-parameter Llama
    mfu            MFU of the default job and of a 1B Llama shape in bf16
    phases         the step's phases adding up to the step (within 5%)
    profile        `overdrive profile`'s verdict on a compute-bound job
    compile        compile.backend=inductor against no compile: tokens/s, the same losses
    vllm           GRPO (LoRA) generating with vLLM colocated, sleep mode on, against overdrive's own
                   sampler: both train; generation seconds per step of each (needs `overdrive[vllm]`)

On a machine without CUDA the GPU rows say so and are skipped; the rows a CPU can run (qlora,
phases) run for real, so CI keeps the script working. Exit code 1 when a row that ran failed.
Budget: about 8 minutes on one H100 or H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src"), str(HERE.parent / "tests")]

import gpu_check_rows as rows  # noqa: E402


def table(results: list[dict]) -> str:
    head = ("row", "result", "seconds", "detail")
    body = [(r["row"], r["result"], f"{r['seconds']:.0f}", r["detail"]) for r in results]
    widths = [max(len(str(line[i])) for line in [head, *body]) for i in range(3)]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(line[:3], widths)) + "  " + line[3]
             for line in [head, *body]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma list of rows (default: all)")
    parser.add_argument("--out", help="where the runs write (default: a temporary directory, removed)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a row's run inside this interpreter
    args, rest = parser.parse_known_args(argv)
    if args.child:
        return rows.child(args.child, rest)
    import torch

    gpu = torch.cuda.is_available()
    wanted = args.only.split(",") if args.only else list(rows.ROWS)
    unknown = [name for name in wanted if name not in rows.ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(rows.ROWS)}")
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'no CUDA device: the GPU rows are skipped'}",
          flush=True)
    holder = tempfile.TemporaryDirectory(prefix="gpu-check-") if not args.out else None
    work = Path(args.out or holder.name)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for name in wanted:
            needs_gpu, check = rows.ROWS[name]
            started = time.perf_counter()
            if needs_gpu and not gpu:
                result, detail = "needs a GPU", "skipped: no CUDA device here"
            else:
                try:
                    ok, detail = check(rows.Context(work, gpu))
                    result = "pass" if ok else "FAIL"
                except Exception as error:  # a row's failure is a result, the next rows still run
                    result, detail = "ERROR", f"{type(error).__name__}: {str(error)[-600:]}"
            results.append({"row": name, "result": result, "seconds": time.perf_counter() - started,
                            "detail": detail})
            print(f"[{name}] {result} ({results[-1]['seconds']:.0f}s): {detail}", flush=True)
    finally:
        if holder is not None:
            holder.cleanup()
    print()
    print(table(results))
    if args.json:
        print(json.dumps(results, indent=1))
    return 1 if any(r["result"] in ("FAIL", "ERROR") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
