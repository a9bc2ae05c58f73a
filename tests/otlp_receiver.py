"""A real OTLP trace receiver on loopback, for tests: OTLP/HTTP (protobuf) and OTLP/gRPC, port 0 each.

It decodes what arrives with opentelemetry-proto's own messages and keeps it in memory: every request's
raw bytes (as received, after HTTP gzip is undone) and every span with its resource attributes.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def attributes(kvs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    """One span as it came over the wire, with plain-Python views of its ids and attributes."""

    proto: Any  # opentelemetry.proto.trace.v1.trace_pb2.Span
    resource: dict[str, Any]
    transport: str  # "http" or "grpc"
    name: str = field(init=False)
    trace_id: str = field(init=False)
    span_id: str = field(init=False)
    parent_span_id: str = field(init=False)
    attributes: dict[str, Any] = field(init=False)
    events: list[tuple[str, int, dict[str, Any]]] = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.proto.name
        self.trace_id = self.proto.trace_id.hex()
        self.span_id = self.proto.span_id.hex()
        self.parent_span_id = self.proto.parent_span_id.hex()
        self.attributes = attributes(self.proto.attributes)
        self.events = [(e.name, e.time_unix_nano, attributes(e.attributes)) for e in self.proto.events]


class OtlpReceiver:
    """Start with :meth:`start`, stop with :meth:`stop`.  Thread-safe; shared by tests (filter by trace id)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.raw: list[bytes] = []
        self.spans: list[ReceivedSpan] = []
        self.http_requests: list[tuple[str, dict[str, str]]] = []  # (path, headers) of every POST
        self._http: ThreadingHTTPServer | None = None
        self._grpc = None

    # ---------------------------------------------------------------- intake
    def _take(self, body: bytes, transport: str) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                spans.extend(ReceivedSpan(s, resource, transport) for s in ss.spans)
        with self._lock:
            self.raw.append(body)
            self.spans.extend(spans)
            self._lock.notify_all()

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with receiver._lock:
                    receiver.http_requests.append((self.path, dict(self.headers)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    receiver._take(body, "http")
                except Exception:  # noqa: BLE001 - a malformed body is the client's error: answer 400
                    self.send_error(400)
                    return
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()

        import grpc

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the generated servicer's naming
                receiver._take(request.SerializeToString(), "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)

    # ---------------------------------------------------------------- addresses
    @property
    def http_endpoint(self) -> str:
        """Base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the SDK appends ``/v1/traces``)."""
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    # ---------------------------------------------------------------- queries
    def find(self, predicate: Callable[[ReceivedSpan], bool]) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if predicate(s)]

    def wait_for(self, predicate: Callable[[ReceivedSpan], bool], timeout: float = 30.0,
                 count: int = 1) -> list[ReceivedSpan]:
        """The received spans matching ``predicate`` once there are at least ``count``; AssertionError
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [s for s in self.spans if predicate(s)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.name, s.trace_id) for s in self.spans})[-20:]
                    raise AssertionError(f"{count} matching span(s) not received in {timeout} s; "
                                         f"got {len(found)}; last spans seen: {names}")
                self._lock.wait(left)

    def raw_bytes(self) -> bytes:
        with self._lock:
            return b"".join(self.raw)
