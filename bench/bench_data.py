"""Data at size: overdrive's tokenization and time to first step against a plain streaming loop.

For each size (MB of text) a corpus is generated in a temporary directory: the Python
standard library's source, repeated, each copy with its own first line so no two copies
are the same text. On that file, one after the other:

1. `overdrive train` at 2 processes from a cold cache (BPE trained on the fly on
   tokenizer.train_max_bytes, tokenization, model, 3 optimizer steps): total time, time to
   the first logged step, peak resident memory of every process;
2. overdrive's tokenization alone (the BPE from run 1 already cached): time, MB/s, peak
   memory, cache size;
3. the streaming loop: the file in 64 KB chunks through the same fast tokenizer (the BPE of
   run 1), uint16 ids appended to a file: time, MB/s, peak memory, output size.

Peak memory is sampled every 0.1 s (psutil) over the process and all its children. The
target: run 1's total time within 1.25x the loop's time (speed >= 0.8x), no process above
2 GiB. Results accumulate in bench/results/data.json by size; the table is written to
bench/results/data.md.

    nice python bench/bench_data.py                 # 100 MB and 1 GB
    nice python bench/bench_data.py --sizes 300     # adds the 300 MB row
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_SPEED = 0.8  # loop time / overdrive's total time, at least
TARGET_RSS_MB = 2048
LOOP = r'''
import sys, numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2], encoding="utf-8", errors="replace") as src, open(sys.argv[3], "wb") as out:
    while True:
        chunk = src.read(65536)
        if not chunk:
            break
        np.asarray(tok.encode(chunk, add_special_tokens=False).ids, dtype=np.uint16).tofile(out)
'''


def make_corpus(path: Path, megabytes: int) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_bytes() for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]
    target, written, copy = megabytes * 1_000_000, 0, 0
    with open(path, "wb") as f:
        while written < target:
            for text in sources:
                chunk = f"# copy {copy} of the standard library\n".encode() + text
                f.write(chunk)
                written += len(chunk)
                if written >= target:
                    break
            copy += 1
    return path


class Sampler:
    """Peak resident memory of a process and of each of its descendants, sampled in a thread."""

    def __init__(self, pid: int, interval: float = 0.1):
        import psutil

        self.root, self.interval, self.peaks, self.names = psutil.Process(pid), interval, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                return
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    if p.pid not in self.names:
                        rank = p.environ().get("RANK")
                        self.names[p.pid] = f"rank {rank}" if rank is not None else p.name()
                except psutil.Error:
                    continue
                self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), rss)
            time.sleep(self.interval)

    def result(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        by_name: dict[str, float] = {}
        for pid, rss in self.peaks.items():
            name = self.names.get(pid, str(pid))
            by_name[name] = max(by_name.get(name, 0.0), rss / 2**20)
        return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def timed(cmd: list[str], env: dict, log: Path) -> tuple[float, dict[str, float], int]:
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        code = proc.wait()
    return time.perf_counter() - start, sampler.result(), code


def bench_size(megabytes: int, work: Path, env: dict) -> dict:
    corpus = make_corpus(work / f"corpus-{megabytes}mb.txt", megabytes)
    size = corpus.stat().st_size
    print(f"== {megabytes} MB: {corpus}", flush=True)
    row: dict = {"mb": size / 1e6}

    # 1. overdrive train, 2 processes, everything cold.
    cache, out = work / f"cache-{megabytes}", work / f"run-{megabytes}"
    started = time.time()
    seconds, peaks, code = timed(
        [sys.executable, "-m", "overdrive.cli", "train", f"data.source={corpus}", f"data.cache_dir={cache}",
         f"output_dir={out}", "launch.num_processes=2", f"launch.main_process_port={random.randint(20000, 60000)}",
         "training.max_steps=3", "training.eval_every_steps=null", "checkpoint.save_final_model=false",
         "logging.progress=false"], env, work / f"train-{megabytes}.log")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    first = next((m["time"] for m in metrics if m.get("step") == 1), None)
    row["train"] = {"seconds": seconds, "first_step_s": first - started if first else None, "peaks_mb": peaks,
                    "exit": code}
    print(f"   overdrive train: {seconds:.0f} s (exit {code}), peaks {peaks}", flush=True)

    # 2. overdrive's tokenization alone, the tokenizer of run 1 already cached.
    tokens_dir = cache / "tokens"
    moved = cache / "tokens-from-train"
    if tokens_dir.exists():
        tokens_dir.rename(moved)
    script = ("import sys; from overdrive import data; from overdrive.config.schema import RunConfig; "
              "from overdrive.training.build.tokenizer import build_tokenizer; "
              "cfg = RunConfig.model_validate({'data': {'source': sys.argv[1], 'cache_dir': sys.argv[2]}}); "
              "data.prepare(cfg, build_tokenizer, show=True)")
    seconds, peaks, code = timed([sys.executable, "-c", script, str(corpus), str(cache)], env,
                                 work / f"tokenize-{megabytes}.log")
    cache_mb = sum(p.stat().st_size for p in tokens_dir.rglob("*") if p.is_file()) / 1e6 if tokens_dir.exists() else 0
    row["tokenize"] = {"seconds": seconds, "peaks_mb": peaks, "cache_mb": cache_mb, "exit": code}
    print(f"   overdrive tokenization: {seconds:.0f} s, {size / 1e6 / seconds:.2f} MB/s, peaks {peaks}", flush=True)

    # 3. The streaming loop with the same tokenizer.
    tokenizer_json = next((cache / "tokenizers").glob("bpe-*/tokenizer.json"))
    ids = work / f"loop-{megabytes}.u16"
    seconds, peaks, code = timed([sys.executable, "-c", LOOP, str(tokenizer_json), str(corpus), str(ids)], env,
                                 work / f"loop-{megabytes}.log")
    row["loop"] = {"seconds": seconds, "peaks_mb": peaks, "cache_mb": ids.stat().st_size / 1e6, "exit": code}
    print(f"   loop: {seconds:.0f} s, {size / 1e6 / seconds:.2f} MB/s, peaks {peaks}", flush=True)
    return row


def _peak(peaks: dict[str, float]) -> str:
    return ", ".join(f"{name} {mb:,.0f}" for name, mb in peaks.items() if mb >= 50)


def write_table(results: dict, path: Path, meta: str) -> bool:
    lines = ["# Data at size: tokenization and time to first step against a streaming loop", "",
             "Corpus: the standard library's source repeated (each copy with its own first line). "
             "Streaming loop: 64 KB chunks through the same fast tokenizer (`Tokenizer.encode`), uint16 ids "
             "appended to a file. overdrive train: 2 processes, cold cache (BPE trained on 20 MB first), "
             "3 optimizer steps. Peak RSS in MiB per process (sampled every 0.1 s; processes under 50 MiB left out). "
             "The three run one after another: on a shared machine whose load changes between them, their times "
             "(and the ratios below) move with that load as much as with the code.",
             "", "| text | what | time | MB/s | time to 1st step | peak RSS per process (MiB) | cache / output |",
             "|---:|---|---:|---:|---:|---|---:|"]
    met = True
    for key in sorted(results, key=int):
        r = results[key]
        mb = r["mb"]
        t, k, loop = r["train"], r["tokenize"], r["loop"]
        first = f"{t['first_step_s']:.0f} s" if t.get("first_step_s") else "-"
        lines.append(f"| {mb:,.0f} MB | overdrive train (2 proc) | {t['seconds']:.0f} s | {mb / t['seconds']:.2f} "
                     f"| {first} | {_peak(t['peaks_mb'])} | |")
        lines.append(f"| | overdrive tokenization | {k['seconds']:.0f} s | {mb / k['seconds']:.2f} | | "
                     f"{_peak(k['peaks_mb'])} | {k['cache_mb']:,.0f} MB |")
        lines.append(f"| | streaming loop | {loop['seconds']:.0f} s | {mb / loop['seconds']:.2f} | | "
                     f"{_peak(loop['peaks_mb'])} | {loop['cache_mb']:,.0f} MB |")
    lines += ["", "| text | loop time / overdrive train time (target >= 0.8) | largest process (target <= 2048 MiB) | "
                  "loop / overdrive tokenization |", "|---:|---:|---:|---:|"]
    for key in sorted(results, key=int):
        r = results[key]
        speed = r["loop"]["seconds"] / r["train"]["seconds"]
        largest = max(r["train"]["peaks_mb"].values())
        ok = speed >= TARGET_SPEED and largest <= TARGET_RSS_MB and r["train"]["exit"] == 0
        met &= ok
        lines.append(f"| {r['mb']:,.0f} MB | {speed:.2f} | {largest:,.0f} MiB | "
                     f"{r['loop']['seconds'] / r['tokenize']['seconds']:.2f} |")
    lines += ["", f"Targets {'met' if met else 'NOT met'} on every size measured.", "", meta, ""]
    path.write_text("\n".join(lines))
    return met


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="MB of text, comma-separated")
    parser.add_argument("--workdir", default=None, help="where corpora and caches go (default: a temp dir)")
    parser.add_argument("--results", default=str(HERE / "results" / "data.json"))
    parser.add_argument("--out", default=str(HERE / "results" / "data.md"))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from --results, run nothing")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    results_path = Path(args.results)
    if args.table_only:  # the table again from the stored results, e.g. after its wording changed
        meta = Path(args.out).read_text().strip().splitlines()[-1] if Path(args.out).exists() else ""
        return 0 if write_table(json.loads(results_path.read_text()), Path(args.out), meta) else 1
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=args.workdir) as tmp:
        for megabytes in (int(s) for s in args.sizes.split(",")):
            row = bench_size(megabytes, Path(tmp), env)
            # Read again just before writing: another invocation may have added its sizes meanwhile.
            results = json.loads(results_path.read_text()) if results_path.exists() else {}
            results[str(megabytes)] = row
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1))
            meta = (f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other work: load "
                    f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}. Written by "
                    f"`python bench/bench_data.py --sizes {args.sizes}` on {time.strftime('%Y-%m-%d %H:%M')}.")
            met = write_table(results, Path(args.out), meta)
    print(f"wrote {args.out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
