#!/usr/bin/env bash
# The test suite on vLLM's CPU build with the real SmolLM2 model (sets up .venv first if needed).
# Two pytest-xdist workers, one unit of work each at a time (a module, or the modules that share a served engine:
# tests/conftest.py), longest first; TEST_WORKERS=0 runs it in one process (as `-k`/one-file runs usually want).
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
workers=${TEST_WORKERS:-2}
dist=()
[ "$workers" != 0 ] && dist=(-n "$workers" --no-loadscope-reorder)
# --durations: every run (CI included) ends with its slowest tests, the list issue 20's 25-minute budget is kept by
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 --durations=25 "${dist[@]}" "$@"
