#!/usr/bin/env bash
# Refresh the tested set: move .venv to the newest releases pyproject.toml's ranges allow, run the
# full suite (the README's test command) on them, and only if it passes write their versions into
# src/overdrive/system/constraints.txt. If the suite fails, the file is left as it was, and
# `bash scripts/setup.sh` puts .venv back on the tested set; docs/installing.md says what next.
set -euo pipefail
cd "$(dirname "$0")/.."

TESTED=src/overdrive/system/constraints.txt
bash scripts/setup.sh --latest
echo "+ the full suite on the newest releases:"
.venv/bin/python -m overdrive env --no-hardware | sed -n '/### Versions/,/^$/p;/^| /p' | head -20
test_command=$(grep -m1 -E '^bash scripts/setup.sh && .* pytest' README.md | sed 's/[[:space:]]*#.*$//; s/^bash scripts\/setup.sh && //')
if ! eval "$test_command"; then
    echo "refresh-tested: the suite failed on the newest releases; $TESTED is unchanged." >&2
    echo "  bash scripts/setup.sh puts .venv back on the tested set (docs/installing.md)." >&2
    exit 1
fi
header=$(grep '^#' "$TESTED")
{
    echo "$header"
    # torch keeps its public version (the tested CPU build is `+cpu`; a GPU box has its own label).
    .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check \
        | grep -v '^#' | sed -E 's/^(torch==[^+]+)\+.*/\1/'
} > "$TESTED.new"
mv "$TESTED.new" "$TESTED"
echo "refresh-tested: $TESTED now holds the set the suite passed on; commit it with the suite's result."
