import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Every vLLM engine of the suite (in-process and the subprocesses, which inherit this) compiles the model with
# inductor.  vLLM 0.32's default AOT compile cache never loads on the CPU build with torch 2.13 ("'function'
# object has no attribute 'finalize_loading'", then "Compiling model again"), so each of the suite's ten or so
# engine starts compiled from scratch (~60-90 s each on 2 cores).  Its older cache path works: a second start of
# the same engine took 49 s instead of 124 s.  Same compiler, same graph; only where the result is cached.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

# vLLM's own switch for its CPU CI (``VLLM_CPU_CI_ENV``, read by ``vllm/platforms/cpu.py`` and ``cpu_worker.py``):
# the model is still traced by dynamo (so a graph break or a guard that attn-otel caused would still show), with
# the same custom ops off as in the compiled build, but the traced graph runs as is instead of through inductor,
# and the start-up warm-up is skipped.  An engine start took 22-30 s with inductor and 4 s with it here (the
# trace, ~10 s, then comes with the first request); the suite starts about thirty engines.  Inductor's own
# compile of a capture engine is still run by tests/test_demo.py (the README's first command, which drops every
# VLLM_ variable) and by every GPU test.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

# The variables that steer attn-otel and the test harness.  A test module that sets one at import (for its
# own engine) would change every engine test collected after it: stop 28's CI served every CPU variant
# model with an fp8 KV cache because tests/test_gpu_variants.py, deselected but still imported, had set
# TEST_KV_DTYPE.  Collection must leave them as it found them.
_STEERING = ("ATTN_OTEL", "TEST_", "VLLM_")
_env_at_start: dict[str, str] = {}


def _steering_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_STEERING)}


def pytest_configure(config):
    _env_at_start.update(_steering_env())


def pytest_collection_finish(session):
    now = _steering_env()
    changed = sorted(k for k in set(now) | set(_env_at_start) if now.get(k) != _env_at_start.get(k))
    if changed:
        raise pytest.UsageError(f"importing the test modules changed {', '.join(changed)} in os.environ; "
                                "set them in a fixture or pass them to the subprocess instead")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """A test of attn-otel's device-side structures on the CPU, and with ``-m gpu`` on a CUDA device too
    (tests/test_stream.py, tests/test_maptap.py)."""
    if request.param == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("the gpu marker needs a CUDA device")
    return request.param


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from attn_otel.smollm2 import ensure_smollm2

    return str(ensure_smollm2())


class Engine:
    """One real vLLM engine (CPU build, in-process so tests can read the capture engine's counters)."""

    def __init__(self, llm, store: Path, model_path: str, served_model_name: str | None = None):
        self.llm = llm
        self.store = store
        self.model_path = model_path
        self.served_model_name = served_model_name

    @property
    def capture(self):
        from attn_otel import vllm_adapter

        engines = vllm_adapter.engines()
        assert len(engines) == 1, engines
        return engines[0]

    def generate(self, prompts, params):
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.drain()
        return outs

    def drain(self) -> None:
        # A finished request reaches the worker in the next step's finished_req_ids; an idle in-process
        # engine only takes that step when asked.
        self.llm.llm_engine.step()
        assert self.capture.flush(120), "captures not written within 120 s"


SERVED_MODEL_NAME = "smollm2-under-test"


@pytest.fixture(scope="session")
def engine(tmp_path_factory, smollm2_path):
    store = tmp_path_factory.mktemp("store")
    env = {
        "ATTN_OTEL": "1",
        "ATTN_OTEL_STORE": str(store),
        "ATTN_OTEL_LAYERS": "all",
        "ATTN_OTEL_MAP_LAYERS": "all",  # maps of every layer (tests/test_engine_stream.py streams them)
        "ATTN_OTEL_MAPS_SAMPLE": "0",
        "ATTN_OTEL_ROW_METRICS": "all",  # the tests compare every capture's rows with NumPy
        "ATTN_OTEL_MAP_TAP_TOKENS": "8192",  # of every layer: 0.3 GiB of the 1 GiB KV-cache space below
        "ATTN_OTEL_VERIFY": "1",  # maps captures check maps x V against the attention output
        "ATTN_OTEL_STORE_TOKENS": "1",  # the exactness tests compare the stored token ids (off by default)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM

    # loaded from a local folder, served under a name of its own: captures record the name, never the path
    llm = LLM(model=smollm2_path, served_model_name=SERVED_MODEL_NAME, max_model_len=2048,
              max_num_batched_tokens=256, max_num_seqs=16, enable_prefix_caching=True, seed=0)
    yield Engine(llm, store, smollm2_path, SERVED_MODEL_NAME)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP trace receiver on loopback (HTTP/protobuf and gRPC, port 0), shared by the session."""
    from otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def moto_s3():
    """moto's S3 server on a loopback port (a real HTTP endpoint), shared by the session."""
    from s3 import MotoS3

    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto_s3, monkeypatch, tmp_path):
    """The AWS variables pointed at the moto server for this test (and for subprocesses it starts)."""
    env = moto_s3.env(tmp_path)
    for name in moto_s3.UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def local_backend(tmp_path):
    from synthetic import LocalBackend

    return LocalBackend(tmp_path / "store")


@pytest.fixture
def s3_backend(moto_s3, s3_env):
    """A store at s3://{fresh bucket}/captures on the moto server."""
    from s3 import S3Backend

    return S3Backend(moto_s3, moto_s3.new_bucket(), env=s3_env)


@pytest.fixture(scope="session")
def otel_server(smollm2_path, tmp_path_factory, otlp_receiver):
    """vLLM's OpenAI server (CPU build) with capture on (metrics unless a request asks for maps:
    ``ATTN_OTEL_MAPS_SAMPLE=0``), its attn_capture spans to the session's OTLP receiver through the standard
    ``OTEL_*`` variables (OTLP/HTTP).  Yields ``(port, store)``.  Shared by tests/test_engine_server.py and
    the ``otel-env`` variant of tests/test_otel_server.py: one server start instead of two."""
    import vllm_server

    store = tmp_path_factory.mktemp("otel-server-store")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_MAPS_SAMPLE": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.http_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    # the worker in the engine-core process, the layout of vLLM on one GPU (the CPU build's default, a worker
    # process of its own, saves nothing but a third vLLM import; tests/test_otel_server.py's vllm-flag server keeps it)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # --enforce-eager: no dynamo trace (~10 s); spans and xargs do not depend on how the other layers run
    with vllm_server.running(smollm2_path, env, tmp_path_factory.mktemp("otel-server-log") / "server.log",
                             ["--enforce-eager"]) as port:
        yield port, store


# --------------------------------------------------------------------- a live vLLM server + a real Prometheus
from scraped import SCRAPED_LAYERS, SCRAPED_PROMPTS  # noqa: E402 - test modules import them from there


class ScrapedServer:
    """What :func:`scraped_server` yields: the Prometheus ``url``, the vLLM ``port`` and ``target``
    (host:port), the ``store``, the ``traces`` of the captured requests, the ``model`` name attn-otel labels
    its series with (the local folder's name: served without --served-model-name), ``vllm_model_name`` (vLLM's
    own ``model_name`` label: the whole path), and the wall-clock ``started`` / ``finished`` times of the
    traffic."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture(scope="session")
def scraped_server(smollm2_path, tmp_path_factory):
    """vLLM's OpenAI server (CPU build) with capture on and maps for every request, scraped every second by a
    real Prometheus as two jobs (``attn-otel``: /attn-otel/metrics with exemplars; ``vllm``: /metrics).
    Traffic: the three SCRAPED_PROMPTS with their own traceparents, more than a second apart (each waited for
    in Prometheus), then one request with ``vllm_xargs {"attn_otel": "off"}`` (skips_total{reason="request_off"},
    not a capture).  Shared by tests/test_prometheus_server.py and tests/test_grafana_live.py."""
    import json
    import time
    import urllib.request

    import prom
    import vllm_server
    from attn_otel.ids import new_span_id, new_trace_id

    if not prom.available():
        pytest.skip("Prometheus is installed by setup.sh")
    store = tmp_path_factory.mktemp("prom-store")
    env = {**os.environ, "ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_MAPS_SAMPLE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name in ("ATTN_OTEL_STATS_DIR", "ATTN_OTEL_LAYERS", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in the engine-core process, as in otel_server
    log_path = tmp_path_factory.mktemp("prom-server-log") / "server.log"
    stop = None

    def complete(body: dict) -> None:
        body = {"model": smollm2_path, "max_tokens": 6, "temperature": 0, **body}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200

    with vllm_server.running(smollm2_path, env, log_path, ["--enforce-eager"]) as port:  # as otel_server
        try:
            target = f"127.0.0.1:{port}"
            url, stop = prom.start([("attn-otel", target, "/attn-otel/metrics"), ("vllm", target, "/metrics")],
                                   workdir=tmp_path_factory.mktemp("prometheus"))
            prom.wait_for(url, 'count(up == 1)', lambda v: v == 2, timeout=30)
            started = time.time()
            traces = []
            for i, prompt in enumerate(SCRAPED_PROMPTS):
                trace = new_trace_id()
                complete({"prompt": prompt, "vllm_xargs": {"traceparent": f"00-{trace}-{new_span_id()}-01"}})
                traces.append(trace)
                # One capture at a time, more than a second apart: the engine writes its counters file at most once
                # a second, so a burst would show in Prometheus as one step.
                prom.wait_for(url, 'sum(attn_otel_sink_mass_first_count{job="attn-otel"})',
                              lambda v: v >= (i + 1) * len(SCRAPED_LAYERS), timeout=120)
                time.sleep(1.1)
            complete({"prompt": "Not captured:", "vllm_xargs": {"attn_otel": "off"}})
            # every capture observed once per captured layer, and the skip, seen by both scrape jobs
            for job in ("attn-otel", "vllm"):
                prom.wait_for(url, f'sum(attn_otel_sink_mass_first_count{{job="{job}"}})',
                              lambda v: v >= len(SCRAPED_PROMPTS) * len(SCRAPED_LAYERS), timeout=60)
                prom.wait_for(url, f'sum(attn_otel_captures_stored_total{{job="{job}"}})',
                              lambda v: v >= len(SCRAPED_PROMPTS), timeout=60)
                prom.wait_for(url, f'sum(attn_otel_skips_total{{job="{job}",reason="request_off"}})',
                              lambda v: v >= 1, timeout=60)
            yield ScrapedServer(url=url, port=port, target=target, store=store, traces=traces,
                                model=Path(smollm2_path).name, vllm_model_name=smollm2_path,
                                started=started, finished=time.time(), log_path=log_path)
        finally:
            if stop is not None:
                stop()


# Two workers (run-tests.sh: pytest-xdist).  A module is one unit of work, so that its module-scoped engines start
# once; modules that share a costly session fixture are one unit (UNITS), so that it starts once, on the worker
# that runs them.  Units go out longest first (UNIT_SECONDS: seconds of test time on the 2-core CI machine,
# 2026-11-29; a unit not named there counts as short), so that neither worker is left alone with a long one at
# the end.  (xdist's own ``--dist loadgroup`` cannot do it with pytest 9.2: it renames items through
# ``item._nodeid``, which pytest no longer reads.)
SHARED_FIXTURES = ("engine", "otel_server", "scraped_server", "disk_engine", "s3_engine", "s3_proxy")
UNITS = {"tests/test_engine_conventions.py": "engine", "tests/test_engine_exact.py": "engine",
         "tests/test_engine_metrics.py": "engine", "tests/test_engine_selection.py": "engine",
         "tests/test_engine_server.py": "otel_server", "tests/test_otel_server.py": "otel_server",
         "tests/test_grafana_live.py": "scraped_server", "tests/test_prometheus_server.py": "scraped_server"}
UNIT_SECONDS = {"reliability": 420, "engine": 300, "test_engine_spec.py": 190, "test_engine_variants.py": 190,
                "test_engine_stream.py": 170, "test_demo.py": 120, "otel_server": 110, "scraped_server": 100,
                "test_parallel.py": 80, "test_engine_mla.py": 70, "test_s3.py": 55, "test_engine_hybrid.py": 50,
                "test_flush_host_bench.py": 50, "test_gc.py": 40, "test_engine_chunked.py": 30}


def unit_of(nodeid: str) -> str:
    """The unit of a test (by its node id, or its module's path in node ids: tests/reliability/test_faults.py)."""
    module = nodeid.split("::")[0]
    return "reliability" if module.startswith("tests/reliability/") else UNITS.get(module, module)


def _check_units(items) -> None:
    """Every module whose tests use one of SHARED_FIXTURES (or name it in their ``SHARES``, where they reach it
    through ``getfixturevalue``) must be in one unit with the other modules that use it."""
    users: dict[str, set[str]] = {}
    for item in items:
        used = (*getattr(item, "fixturenames", ()), *getattr(getattr(item, "module", None), "SHARES", ()))
        for name in SHARED_FIXTURES:
            if name in used:
                users.setdefault(name, set()).add(item.nodeid.split("::")[0])
    for name, mods in users.items():
        if len({unit_of(m) for m in mods}) > 1:
            msg = f"{', '.join(sorted(mods))} share {name}: give them one unit in tests/conftest.py's UNITS"
            print(f"\nERROR: {msg}", file=sys.__stderr__, flush=True)  # (xdist reports a worker's error as a crash)
            raise pytest.UsageError(msg)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """In the controller: xdist's scheduling by scope, the scope of a test its module's unit."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests on the in-process engine run first, so that it starts before the other modules' imports.  When an
    engine starts, vLLM's CPU platform walks every loaded module's globals (``vllm.triton_utils.dispatcher``)
    and tripped over flask's context proxies while moto's S3 server ran in this process.  It runs in a process
    of its own now (tests/s3.py); the order stays, against the next module of that kind.

    In an xdist worker the units are ordered longest first (the controller sends them in this order), after a
    check that UNITS groups the modules that share a served session fixture."""
    items.sort(key=lambda item: 0 if "engine" in getattr(item, "fixturenames", ()) else 1)
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    _check_units(items)
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(unit_of(item.nodeid), len(order))

    def first(item):
        unit = unit_of(item.nodeid)
        return -UNIT_SECONDS.get(Path(unit).name, 0), order[unit]

    items.sort(key=first)
