"""Fixtures of the reliability suite: real engines in processes of their own (see driver.py), an S3 server
behind a proxy that the tests break on purpose, and a local store on a small filesystem that they fill.

Two engines, each started once per session and only when a test asks for it (about 25 s each):

- ``s3_engine``: captures to ``s3://bucket/captures`` on moto's server, reached through a
  :class:`faulty_proxy.FaultyProxy`; token ids stored (``ATTN_OTEL_STORE_TOKENS=1``); spans to a real OTLP
  receiver; stats dir for Prometheus; a 2 MiB hand-off so that an outage fills it quickly.
- ``disk_engine``: captures to a local folder on a 256 MiB tmpfs mounted for the session (needs root;
  without it the folder is an ordinary one and the full-disk test is skipped); ``ATTN_OTEL_STORE_TOKENS=0``,
  ``ATTN_OTEL_MAX_MAP_TOKENS=64``, a map tap of ``MAP_TAP_TOKENS`` (every request of test_load's ``LOAD_REQUESTS`` keeps
  its queries: the load reaches the hand-offs, not the tap's bound), 16 MiB host and 16 MiB device hand-offs.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

S3_QUEUE_BYTES = 2 << 20
DISK_QUEUE_BYTES = 16 << 20
DISK_DEVICE_QUEUE_BYTES = 16 << 20
MAX_MAP_TOKENS = 64
LOAD_REQUESTS = 200  # test_load's concurrent requests, all planned for maps
# twice what LOAD_REQUESTS requests of MAX_MAP_TOKENS hold at once: rows come back only at finish batches
MAP_TAP_TOKENS = 2 * LOAD_REQUESTS * MAX_MAP_TOKENS
S3_TIMEOUT_S = 2


class Driver:
    """The parent's end of driver.py: send a command, wait (bounded) for its one-line answer."""

    def __init__(self, model: str, env: dict[str, str], config: dict, workdir: Path, start_timeout: float = 400):
        self.workdir = workdir
        self.stdout_path = workdir / "engine.stdout"
        self.stderr_path = workdir / "engine.stderr"
        self.attn_log = workdir / "attn_otel.log"
        config = {**config, "attn_log": str(self.attn_log)}
        read_fd, write_fd = os.pipe()
        self._reply = os.fdopen(read_fd, "r")
        self._buf = ""
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "driver.py"), model, json.dumps(config), str(write_fd)],
            stdin=subprocess.PIPE, stdout=open(self.stdout_path, "w"), stderr=open(self.stderr_path, "w"),
            env=env, text=True, pass_fds=(write_fd,), cwd=workdir)
        os.close(write_fd)
        self.ready = self._answer(start_timeout)
        self.pid = self.proc.pid

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine did not answer within {timeout} s\n{self.logs()[-3000:]}")
            ready, _, _ = select.select([self._reply], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._reply.fileno(), 1 << 20).decode()
                if not chunk:
                    raise RuntimeError(f"engine exited ({self.proc.poll()})\n{self.logs()[-3000:]}")
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        return json.loads(line)

    def call(self, op: str, timeout: float = 300, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def generate(self, prompts, extra_args=None, max_tokens: int = 8, timeout: float = 300, **kw) -> dict:
        return self.call("generate", timeout=timeout, prompts=list(prompts), extra_args=extra_args,
                         max_tokens=max_tokens, **kw)

    def stats(self) -> dict:
        return self.call("stats")["stats"]

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.stdout_path, self.stderr_path)
                       if p.exists())

    def attn_logs(self) -> str:
        return self.attn_log.read_text(errors="replace") if self.attn_log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=30)
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()
        self._reply.close()


_DRIVERS: list[Driver] = []  # the engines of this folder's fixtures (stop_engines)


def stop_engines() -> None:
    """Stop this folder's engines once its last test has run: they are session fixtures (its modules share them),
    and left running an idle engine took a tenth of a core and about 3 GB each for the rest of the suite."""
    while _DRIVERS:
        driver = _DRIVERS.pop()
        if getattr(driver, "proxy", None) is not None:  # its writes drain to an endpoint that answers
            driver.proxy.mode = "up"
        driver.stop()


def _engine_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATTN_OTEL", "OTEL_", "AWS_")) and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update({"ATTN_OTEL": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "ATTN_OTEL_MAPS_SAMPLE": "1"})
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def s3_proxy(moto_s3):
    from faulty_proxy import FaultyProxy

    host, port = moto_s3.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = FaultyProxy(host, int(port))
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def s3_engine(smollm2_path, moto_s3, s3_proxy, otlp_receiver, tmp_path_factory):
    from s3 import S3Backend

    work = tmp_path_factory.mktemp("s3-engine")
    bucket = moto_s3.new_bucket()
    aws = moto_s3.env(work)
    aws["AWS_ENDPOINT_URL"] = s3_proxy.endpoint
    backend = S3Backend(moto_s3, bucket, env=aws)
    stats_dir = work / "stats"
    env = _engine_env({**aws, "ATTN_OTEL_STORE": backend.url, "ATTN_OTEL_QUEUE_BYTES": str(S3_QUEUE_BYTES),
                       "ATTN_OTEL_S3_TIMEOUT_S": str(S3_TIMEOUT_S), "ATTN_OTEL_STATS_DIR": str(stats_dir),
                       "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.http_endpoint,
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200",
                       "ATTN_OTEL_STORE_TOKENS": "1"})  # test_security checks stored ids stay in the store
    driver = Driver(smollm2_path, env, {"max_num_seqs": 64}, work)
    _DRIVERS.append(driver)
    driver.backend = backend
    driver.proxy = s3_proxy
    driver.stats_dir = stats_dir
    yield driver
    s3_proxy.mode = "up"
    driver.stop()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return res.returncode == 0


@pytest.fixture(scope="session")
def disk_engine(smollm2_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("disk-engine")
    mount = work / "fs"
    mounted = _mount_tmpfs(mount, "256m")
    store = mount / "store"
    env = _engine_env({"ATTN_OTEL_STORE": str(store), "ATTN_OTEL_STORE_TOKENS": "0",
                       "ATTN_OTEL_MAX_MAP_TOKENS": str(MAX_MAP_TOKENS),
                       "ATTN_OTEL_MAP_TAP_TOKENS": str(MAP_TAP_TOKENS),
                       "ATTN_OTEL_QUEUE_BYTES": str(DISK_QUEUE_BYTES),
                       "ATTN_OTEL_DEVICE_QUEUE_BYTES": str(DISK_DEVICE_QUEUE_BYTES)})
    try:  # the tmpfs is unmounted also when the engine does not start (it stayed mounted under /tmp before)
        driver = Driver(smollm2_path, env, {"max_num_seqs": 256}, work)
        _DRIVERS.append(driver)
        driver.store = store
        driver.mount = mount if mounted else None
        yield driver
        driver.stop()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# ------------------------------------------------------------------------------------------ helpers

def traceparent(trace_id: str) -> str:
    from attn_otel.ids import new_span_id

    return f"00-{trace_id}-{new_span_id()}-01"


def delta(after: dict, before: dict) -> dict:
    """Counter differences between two stats snapshots (reasons flattened as ``dropped.queue_full``)."""
    out = {}
    for key in ("captured", "stored", "maps_stored"):
        out[key] = after[key] - before[key]
    for key in ("dropped", "skipped", "export_errors"):
        for reason in set(after[key]) | set(before[key]):
            n = after[key].get(reason, 0) - before[key].get(reason, 0)
            if n:
                out[f"{key}.{reason}"] = n
    return out


# Drops decided before a capture is counted as captured (the request never reached the hand-off), and
# skips that end a capture.  Every finished request is exactly one of: captured, or one of these.
BEFORE_CAPTURE_DROPS = ("dropped.queue_full", "dropped.device_queue_full", "dropped.capture_error")
ENDING_SKIPS = ("skipped.request_off", "skipped.no_tokens", "skipped.no_layers")
AFTER_CAPTURE_DROPS = ("dropped.store_error", "dropped.shutdown")


def assert_accounted(d: dict, requests: int) -> None:
    """Nothing silently lost: each request captured or counted; each capture stored or counted."""
    before = sum(d.get(k, 0) for k in BEFORE_CAPTURE_DROPS + ENDING_SKIPS)
    after = sum(d.get(k, 0) for k in AFTER_CAPTURE_DROPS)
    assert d["captured"] + before == requests, d
    assert d["stored"] + after == d["captured"], d
