"""A real Prometheus server for tests (Debian's ``/usr/bin/prometheus``, installed by setup.sh).

    url, stop = start([("attn-otel", "127.0.0.1:8000", "/attn-otel/metrics"), ("vllm", "127.0.0.1:8000", "/metrics")])
    try:
        wait_for(url, 'sum(attn_otel_captures_total{job="vllm"})', lambda v: v >= 3)
        series = query(url, 'attn_otel_sink_mass_first_bucket{le="+Inf"}')      # [{"metric": {...}, "value": [t, "3"]}]
        exemplars = query_exemplars(url, "attn_otel_sink_mass_first_bucket")
    finally:
        stop()

Scrapes every second, with exemplar storage on (OpenMetrics targets' exemplars are kept).  Each target is
``(job, "host:port", metrics_path)``.  The TSDB and the log live in ``workdir`` (a temporary directory when
None, removed by ``stop``).  Every query goes through Prometheus's HTTP API and raises on an error answer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Sequence

from vllm_server import free_port

PROMETHEUS = os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus")


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK)

def config_yaml(targets: Sequence[tuple[str, str, str]], interval: str = "1s") -> str:
    # JSON is YAML: no yaml dependency needed
    return json.dumps({
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "metrics_path": path, "static_configs": [{"targets": [target]}]}
                           for job, target, path in targets],
    }, indent=2)

def start(targets: Sequence[tuple[str, str, str]], workdir: str | os.PathLike | None = None,
          timeout: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Start Prometheus scraping ``targets``; returns ``(base url, stop)`` once it answers ready."""
    own = workdir is None
    work = tempfile.mkdtemp(prefix="prometheus-") if own else os.fspath(workdir)
    os.makedirs(work, exist_ok=True)
    config = os.path.join(work, "prometheus.yml")
    with open(config, "w") as f:
        f.write(config_yaml(targets))
    port = free_port()
    log = open(os.path.join(work, "prometheus.log"), "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(work, 'tsdb')}",
                             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return url, stop
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            text = open(os.path.join(work, "prometheus.log")).read()[-3000:]
            stop()
            raise RuntimeError(f"Prometheus did not come up: {text}")
        time.sleep(0.2)

def api(url: str, path: str, **params) -> object:
    """GET ``/api/v1/{path}`` with ``params``; the ``data`` of a successful answer."""
    full = f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(full, timeout=30) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path} {params}: HTTP {e.code}: {e.read()[:500]!r}") from None
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]

def query(url: str, promql: str) -> list[dict]:
    """An instant query's result: ``[{"metric": {labels}, "value": [time, "string value"]}, ...]``."""
    data = api(url, "query", query=promql)
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]

def value(url: str, promql: str) -> float | None:
    """The value of a query that returns one series or a scalar (None when it returns nothing)."""
    result = query(url, promql)
    if not result:
        return None
    if len(result) > 1:
        raise RuntimeError(f"{promql} returned {len(result)} series")
    return float(result[0]["value"][1])

def query_exemplars(url: str, promql: str, start: float | None = None, end: float | None = None) -> list[dict]:
    """``/api/v1/query_exemplars``: ``[{"seriesLabels": {...}, "exemplars": [{"labels", "value", "timestamp"}]}]``."""
    now = time.time()
    return api(url, "query_exemplars", query=promql, start=start if start is not None else now - 3600,
               end=end if end is not None else now + 60)

def targets(url: str) -> list[dict]:
    """The active targets, each with ``labels``, ``health`` and ``lastError``."""
    return api(url, "targets")["activeTargets"]

def wait_for(url: str, promql: str, predicate: Callable[[float], bool], timeout: float = 60.0) -> float:
    """Poll ``value(promql)`` until ``predicate`` holds; returns the value, or raises with the last one."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = value(url, promql)
        if last is not None and predicate(last):
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"{promql} = {last} after {timeout} s; targets: "
                               f"{[(t['labels'].get('job'), t['health'], t['lastError']) for t in targets(url)]}")
        time.sleep(0.5)
