"""The model and prompts of rl_lookup.yaml: a 2-layer Llama with a word-level tool-calling chat template, warmed
by next-token training on lookup exchanges (it learns to copy a tool's result and to call the tool about one
time in six), and 40 prompts `find kN` with the table's value as their answer. Usage: make_lookup.py DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from env_fixtures import make_lookup_llama, warm_lookup, write_lookup_prompts  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    make_lookup_llama(out / "base", hidden_size=64)
    warm_lookup(out / "base", p_call=0.2)
    write_lookup_prompts(out / "prompts.jsonl")
    print(f"model: {out / 'base'}  prompts: {out / 'prompts.jsonl'}")
