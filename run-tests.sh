#!/usr/bin/env bash
# The test suite on vLLM's CPU build with the real SmolLM2 model (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
# --durations: every run (CI included) ends with its slowest tests, the list issue 20's 25-minute budget is kept by.
# Two workers (TEST_WORKERS; 0 runs in this process), a test module each at a time (--dist loadfile keeps a
# module's engines, started once for it, on one worker): a served engine's start is mostly one Python thread, so
# on the 2-core CI machine two modules at once take far less than one after the other.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 --durations=25 \
  -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
