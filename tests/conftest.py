import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from attn_otel.smollm2 import ensure_smollm2

    return str(ensure_smollm2())


class Engine:
    """One real vLLM engine (CPU build, in-process so tests can read the capture engine's counters)."""

    def __init__(self, llm, store: Path, model_path: str):
        self.llm = llm
        self.store = store
        self.model_path = model_path

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


@pytest.fixture(scope="session")
def engine(tmp_path_factory, smollm2_path):
    store = tmp_path_factory.mktemp("store")
    env = {
        "ATTN_OTEL": "1",
        "ATTN_OTEL_STORE": str(store),
        "ATTN_OTEL_LAYERS": "all",
        "ATTN_OTEL_MAPS_SAMPLE": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM

    llm = LLM(model=smollm2_path, max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=16,
              enable_prefix_caching=True, seed=0)
    yield Engine(llm, store, smollm2_path)
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
