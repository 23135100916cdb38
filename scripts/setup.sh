#!/usr/bin/env bash
# Create or reuse .venv in the checkout and install overdrive with everything it runs on.
# torch goes first: a bare `torch` requirement on a machine without it would pull a
# multi-GB CUDA build; here a CPU build is installed, and a machine that already has torch
# (a GPU box) keeps the one it has. DeepSpeed builds against that torch, so it is installed
# without build isolation.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    "${PIP[@]}" install "torch==2.13.0"
fi
"${PIP[@]}" install -e ".[test,tensorboard,eval]"  # eval: lm-evaluation-harness (eval.tasks, overdrive eval)
if ! .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
    "${PIP[@]}" install --no-build-isolation "deepspeed>=0.16"
fi
