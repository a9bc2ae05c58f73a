"""vLLM's OpenAI server (CPU build) as a subprocess for the tests: start it, wait for /health, stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(model: str, env: Mapping[str, str], log_path: Path, args: Sequence[str] = (),
            timeout: float = 600) -> Iterator[int]:
    """``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm serve`` fails, see DESIGN.md)
    on a free loopback port; yields the port once /health answers, and stops the server's process group."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", *args],
                                env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    assert proc.poll() is None, Path(log_path).read_text()[-3000:]
                    if time.monotonic() > deadline:
                        pytest.fail(f"vLLM server did not come up in {timeout:.0f} s")
                    time.sleep(0.5)
            yield port
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
