"""A real S3 endpoint for the tests: moto's S3 server over HTTP on a loopback port, one per session, and a
view of one bucket that the tests inspect with boto3 (not through attn_otel)."""

from __future__ import annotations

import itertools
import logging
import os

# Sent with every request, and so a string that must never show up in a message or a log line.
ACCESS_KEY = "AKIATESTATTNOTEL0001"
SECRET_KEY = "attn-otel-test-secret-must-never-be-logged"


class MotoS3:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
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
        self._server.stop()


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
