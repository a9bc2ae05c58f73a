#!/usr/bin/env bash
# The test suite on vLLM's CPU build with the real SmolLM2 model (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
# --durations: every run (CI included) ends with its slowest tests, the list issue 20's 25-minute budget is kept by
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 --durations=25 "$@"
