#!/usr/bin/env bash
# The test suite on vLLM's CPU build with the real SmolLM2 model (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 "$@"
