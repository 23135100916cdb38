#!/usr/bin/env bash
# Create or reuse .venv in the checkout and install overdrive with everything it runs on, at the
# tested versions: src/overdrive/system/constraints.txt, the exact set the full suite passed
# on, given to pip as constraints (an existing .venv is moved onto it).
#
#   bash scripts/setup.sh             the tested set (what CI and the README's commands install)
#   bash scripts/setup.sh --latest    the newest releases pyproject.toml's ranges allow instead
#   OVERDRIVE_DEPS=latest bash scripts/setup.sh    the same, for scripts that cannot pass flags
#
# torch goes first: a bare `torch` requirement on a machine without it would pull a multi-GB
# CUDA build; here a CPU build is installed, and a machine that already has torch (a GPU box)
# keeps the one it has, so torch's own pin is left out of the constraints there. DeepSpeed builds
# against that torch, so it is installed without build isolation.
set -euo pipefail
cd "$(dirname "$0")/.."

DEPS="${OVERDRIVE_DEPS:-tested}"
for arg in "$@"; do
    case "$arg" in
        --latest) DEPS=latest ;;
        --tested) DEPS=tested ;;
        *) echo "setup.sh: unknown option $arg (use --latest or --tested)" >&2; exit 2 ;;
    esac
done
case "$DEPS" in
    tested|latest) ;;
    *) echo "setup.sh: OVERDRIVE_DEPS=$DEPS: use tested or latest" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
TESTED=src/overdrive/system/constraints.txt
TORCH_PIN=$(grep -m1 '^torch==' "$TESTED")

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    "${PIP[@]}" install "$TORCH_PIN"
    torch_here=tested
else
    torch_here=own
fi
# The constraints pip resolves under: the tested set, or with --latest only torch held where it is
# (an eager upgrade would otherwise replace a CPU torch with the registry's multi-GB CUDA build).
constraints_file=$(mktemp)
trap 'rm -f "$constraints_file"' EXIT
UPGRADE=()
if [ "$DEPS" = tested ]; then
    if [ "$torch_here" = own ]; then
        grep -v '^torch==' "$TESTED" > "$constraints_file"  # keep the torch this machine has
    else
        cp "$TESTED" "$constraints_file"
    fi
else
    .venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$constraints_file"
    UPGRADE=(--upgrade --upgrade-strategy eager)
fi
CONSTRAINTS=(-c "$constraints_file")

"${PIP[@]}" install "${UPGRADE[@]}" "${CONSTRAINTS[@]}" -e ".[test,tensorboard,eval]"  # eval: lm-evaluation-harness
# DeepSpeed compiles against the torch above: without build isolation, and only when missing
# or not the version asked for.
deepspeed_wanted=$(grep -m1 '^deepspeed==' "$TESTED" | cut -d= -f3)
deepspeed_have=$(.venv/bin/python -c "from importlib.metadata import version; print(version('deepspeed'))" 2>/dev/null || true)
if [ "$DEPS" = latest ]; then
    "${PIP[@]}" install --no-build-isolation --upgrade "${CONSTRAINTS[@]}" "deepspeed>=0.16,<1"
elif [ "$deepspeed_have" != "$deepspeed_wanted" ]; then
    "${PIP[@]}" install --no-build-isolation "${CONSTRAINTS[@]}" "deepspeed==$deepspeed_wanted"
fi
