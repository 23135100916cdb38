"""Tokenize one text file into a token cache in this process, for tests/test_data_scale.py.

    python tests/data_probe.py --source corpus.txt --tokenizer tok_dir --cache cache_dir --out probe.json

Writes {"rss_before_mb", "rss_peak_mb", "meta"} (the peak resident set of this process before
and after tokenizing, from getrusage, and the cache entry's done.json).
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    from overdrive import data
    from overdrive.config.schema import RunConfig

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    cfg = RunConfig.model_validate({"data": {"source": args.source, "cache_dir": args.cache,
                                             "validation_fraction": 0.01}})
    splits = data.open_splits(cfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = data.tokenize(cfg, splits, tokenizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    entry = Path(tokens.train.tokens.filename).parent
    meta = json.loads((entry / "done.json").read_text())
    Path(args.out).write_text(json.dumps({"rss_before_mb": before, "rss_peak_mb": peak, "meta": meta,
                                          "entry": str(entry)}))


if __name__ == "__main__":
    main()
