"""A real S3 endpoint for the tests: moto's S3 server over HTTP on a loopback port, one per session, and a
view of one bucket that the tests inspect with boto3 (not through attn_otel)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import urllib.request

# Sent with every request, and so a string that must never show up in a message or a log line.
ACCESS_KEY = "AKIATESTATTNOTEL0001"
SECRET_KEY = "attn-otel-test-secret-must-never-be-logged"


class MotoS3:
    """moto's server in a process of its own (``python -m moto.server``): nothing of flask or moto is imported
    into the test process, whose in-process vLLM engine must not meet flask's context proxies (see
    ``pytest_collection_modifyitems`` in tests/conftest.py), whichever order the test workers take the modules in."""

    def __init__(self, timeout: float = 60.0) -> None:
        from vllm_server import free_port

        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._proc.kill()
                    raise RuntimeError(f"moto's server did not come up on port {port} "
                                       f"(exit code {self._proc.poll()})") from None
                time.sleep(0.1)
        self._names = itertools.count()

    def env(self, home: os.PathLike) -> dict[str, str]:
        """The standard AWS variables for this endpoint; shared config files pointed away from ~/.aws."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": os.path.join(home, "aws-config-none"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(home, "aws-credentials-none"),
        }

    # Variables that would point the code elsewhere than this server.
    UNSET = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"attn-otel-test-{os.getpid()}-{next(self._names)}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class S3Backend:
    """A store at ``s3://{bucket}/{prefix}`` on the moto server."""

    name = "s3"

    def __init__(self, s3: MotoS3, bucket: str, prefix: str = "captures", env: dict[str, str] | None = None):
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.missing_url = f"s3://no-such-bucket-{bucket}/x"
        self.missing_name = f"no-such-bucket-{bucket}"
        self.env = dict(env or {})  # for subprocesses
        self._client = s3.client()

    def _all(self) -> dict[str, int]:
        out = {}
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out

    def keys(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of the objects under ``prefix``, keys relative to the store root."""
        root = self.prefix + "/"
        return {k[len(root):]: n for k, n in self._all().items() if k.startswith(root + prefix)}

    def outside_keys(self) -> list[str]:
        """Objects in the bucket that are not under the store root."""
        return [k for k in self._all() if not k.startswith(self.prefix + "/")]

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
