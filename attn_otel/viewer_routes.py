"""The viewer on vLLM's API server: the page of :mod:`attn_otel.viewer` and the data it fetches, by trace id.

Routes (GET; ``request`` picks the capture when a trace has several, else the trace's first is shown)::

    /attn-otel/view/{trace_id}[?request=ID]                         the page (HTML, metrics and labels in it)
    /attn-otel/view/{trace_id}/capture[?request=ID]                 the page's data as JSON
    /attn-otel/view/{trace_id}/map?layer=L&head=H|mean[&request=ID] one map's codes (zlib, see attn_otel.viewer)

A map request reads only the chunks of its layer: one head's, or every head's for the mean over heads, one
band of query rows at a time; recent maps are kept (:data:`MAP_CACHE_BYTES`), so switching back is free.

Errors are ``{"error": message}`` (the page: the message as text): 400 for a malformed trace id, layer or
head; 404 for a trace, request, layer or head the store does not have, and for the maps of a metrics-only
capture; 500 when the store cannot be read (the details go to the server's log).

Authentication: vLLM's ``--api-key`` (else ``VLLM_API_KEY``) guards only its API paths (``/v1``, ``/v2``,
``/inference``, and ``/cohere`` in 0.32: ``GUARDED_PREFIX`` of its ``AuthenticationMiddleware``, in 0.26 and
0.32 alike), not these.  So these
routes check the same keys themselves, the way vLLM does (SHA-256 digests, constant-time comparison), and
accept them as ``Authorization: Bearer KEY`` (like the OpenAI API) or as HTTP Basic credentials with the key
as password and any user name, which a browser asks for on its own: a 401 says ``WWW-Authenticate: Basic``,
and the page's map requests then carry what the browser was given.  Without a key the routes are open, like
vLLM's ``/metrics``.

The store (``ATTN_OTEL_STORE`` of the server's process unless given) is read in worker threads, never on
the server's event loop, :data:`READERS` at a time.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import html
import logging
import os
import secrets
import threading
import time
from typing import Any, Sequence

from . import viewer
from .ids import check_trace_id
from .reader import Capture, TraceNotFound, open_trace
from .store import StoreError, open_zarr_store

logger = logging.getLogger("attn_otel")

ROUTE = viewer.VIEW_ROUTE
READERS = 2
MAP_CACHE_BYTES = 64 << 20
TRACE_CACHE_S = 30.0
TRACE_CACHE_ENTRIES = 256


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def api_keys(args: Any = None, env=None) -> list[str]:
    """The keys vLLM's server requires, by vLLM's own rule (0.26's ``build_app``, 0.32's
    ``init_entrypoints_middleware``): ``--api-key`` (a list; a lone string counts as one key) wins over
    ``VLLM_API_KEY``; empty values do not count."""
    env = os.environ if env is None else env
    given = getattr(args, "api_key", None)
    if isinstance(given, str):
        given = [given]
    return [k for k in (given or [env.get("VLLM_API_KEY")]) if k]


class Viewer:
    """The viewer's routes over one store.  ``api_keys``: required keys (none: open).  ``tokenizer`` (a
    folder or a tokenizer) decodes the token ids of captures whose model is ``model`` (the served model name);
    other captures' axes show token ids.  :meth:`configure` takes both from vLLM's parsed arguments."""

    def __init__(self, store=None, *, api_keys: Sequence[str] = (), tokenizer=None, model: str | None = None):
        self.store = store
        self.tokenizer = tokenizer
        self.model = model
        self._keys: list[bytes] = []
        self.set_api_keys(api_keys)
        self._zstore = None
        self._lock = threading.Lock()
        self._traces: collections.OrderedDict[str, tuple[float, list[Capture]]] = collections.OrderedDict()
        self._maps: collections.OrderedDict[tuple[str, int, str], bytes] = collections.OrderedDict()
        self._map_bytes = 0
        self._tokenizer_failed = False
        self._limiter = None

    def set_api_keys(self, keys: Sequence[str]) -> None:
        self._keys = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys if k]

    def configure(self, args: Any) -> None:
        """Keys, tokenizer and served model name from vLLM's parsed server arguments."""
        from .tracking import model_name

        self.set_api_keys(api_keys(args))
        self.tokenizer = getattr(args, "tokenizer", None) or getattr(args, "model", None) or self.tokenizer
        self.model = model_name(getattr(args, "served_model_name", None), getattr(args, "model", None)) or None

    def authorized(self, header: str | None) -> bool:
        if not self._keys:
            return True
        scheme, _, param = (header or "").partition(" ")
        if scheme.lower() == "basic":
            try:
                param = base64.b64decode(param.strip(), validate=True).decode("utf-8").partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for key in self._keys:
            match |= secrets.compare_digest(digest, key)
        return match

    def clear_cache(self) -> None:
        """Forget the traces and maps read so far (the next view reads the store again)."""
        with self._lock:
            self._traces.clear()
            self._maps.clear()
            self._map_bytes = 0

    # --- reading (worker threads) ----------------------------------------------------------------------
    def _store(self):
        if self._zstore is None:
            if self.store is not None and not isinstance(self.store, (str, os.PathLike)):
                self._zstore = self.store
            else:
                from urllib.parse import urlparse

                from .config import Config

                url = os.fspath(self.store or Config.from_env().store)
                parsed = urlparse(url)
                local = parsed.path if parsed.scheme == "file" else url if not parsed.scheme else None
                if local is not None and not os.path.isdir(os.path.expanduser(local)):
                    raise HttpError(404, "no capture is stored yet")  # the writers make the store
                self._zstore = open_zarr_store(url, read_only=True)
        return self._zstore

    def captures(self, trace_id: str) -> list[Capture]:
        trace_id = check_trace_id(trace_id)  # ValueError: 400, before the store is touched
        now = time.monotonic()
        with self._lock:
            hit = self._traces.get(trace_id)
            if hit is not None and now - hit[0] < TRACE_CACHE_S:
                return hit[1]
        try:
            caps = open_trace(trace_id, self._store())
        except TraceNotFound:
            raise HttpError(404, f"no capture of trace {trace_id}") from None
        with self._lock:
            self._traces[trace_id] = (now, caps)
            while len(self._traces) > TRACE_CACHE_ENTRIES:
                self._traces.popitem(last=False)
        return caps

    def capture(self, trace_id: str, request: str | None) -> tuple[Capture, list[Capture]]:
        caps = self.captures(trace_id)
        if request is None:
            return caps[0], caps
        for cap in caps:
            if cap.request_id == request:
                return cap, caps
        raise HttpError(404, f"trace {trace_id} has no request {request!r}")

    def labels(self, cap: Capture) -> tuple[list[str] | None, str]:
        """Decoded tokens for this server's own model's captures (when they stored token ids), else ids."""
        if not (cap.meta.get("token_ids") and self.model and cap.model == self.model and self.tokenizer is not None
                and not self._tokenizer_failed):
            return viewer.token_labels(cap, None)
        try:
            if isinstance(self.tokenizer, (str, os.PathLike)):
                self.tokenizer = viewer.load_tokenizer(self.tokenizer)  # loaded once, then kept
            return viewer.token_labels(cap, self.tokenizer)
        except ValueError as e:  # no tokenizer after all: ids, said once
            logger.warning("attn-otel viewer: labelling tokens by id: %s", e)
            self._tokenizer_failed = True
            return viewer.token_labels(cap, None)

    def data(self, trace_id: str, request: str | None) -> dict[str, Any]:
        cap, caps = self.capture(trace_id, request)
        labels, kind = self.labels(cap)
        data = viewer.page_data(cap, labels, kind, [c.request_id for c in caps])
        data["maps"] = {"source": "served"}
        return data

    def map_codes(self, trace_id: str, request: str | None, layer: str | None, head: str | None) -> bytes:
        cap, _ = self.capture(trace_id, request)
        if not (layer or "").isdigit():
            raise HttpError(400, f"layer must be a model layer number, not {layer!r}")
        if int(layer) not in cap.layers:
            raise HttpError(404, f"layer {int(layer)} was not captured (captured: {cap.layers})")
        li = cap.layers.index(int(layer))
        if head != viewer.MEAN and not (head or "").isdigit():
            raise HttpError(400, f"head must be 'mean' or a number, not {head!r}")
        h = None if head == viewer.MEAN else int(head)
        if h is not None and h >= cap.num_heads:
            raise HttpError(404, f"head {h} does not exist (the capture has {cap.num_heads})")
        if not cap.has_maps:
            raise HttpError(404, f"request {cap.request_id!r} of trace {cap.trace_id} has metrics only, no maps")
        key = (cap.prefix, li, viewer.map_id(li, h))
        with self._lock:
            if key in self._maps:
                self._maps.move_to_end(key)
                return self._maps[key]
        codes = viewer.layer_codes(cap, li, [] if h is None else [h], mean=h is None)[viewer.map_id(li, h)]
        blob = viewer.compress(codes, 1)
        with self._lock:
            if key not in self._maps:
                self._maps[key] = blob
                self._map_bytes += len(blob)
            while self._map_bytes > MAP_CACHE_BYTES and len(self._maps) > 1:
                self._map_bytes -= len(self._maps.popitem(last=False)[1])
        return blob

    # --- HTTP (the event loop) -------------------------------------------------------------------------
    async def _run(self, fn, *args):
        import anyio

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(READERS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def _handle(self, request, kind: str):
        from starlette.responses import HTMLResponse, JSONResponse, Response

        page = kind == "page"

        def error(status: int, message: str, headers: dict[str, str] | None = None):
            if page:
                return HTMLResponse(f"<!DOCTYPE html><title>attn-otel viewer</title><p>{html.escape(message)}</p>",
                                    status, headers=headers)
            return JSONResponse({"error": message}, status, headers=headers)

        if not self.authorized(request.headers.get("authorization")):
            return error(401, "Unauthorized: give the server's API key (Bearer, or as the password)",
                         {"WWW-Authenticate": 'Basic realm="attn-otel viewer", charset="UTF-8"'})
        trace_id = request.path_params["trace_id"]
        query = request.query_params
        try:
            if kind == "map":
                blob = await self._run(self.map_codes, trace_id, query.get("request"), query.get("layer"),
                                       query.get("head", viewer.MEAN))
                return Response(blob, media_type="application/octet-stream",
                                headers={"Cache-Control": "private, max-age=3600", "X-Content-Type-Options": "nosniff"})
            data = await self._run(self.data, trace_id, query.get("request"))
        except HttpError as e:
            return error(e.status, str(e))
        except ValueError as e:  # a malformed trace id
            return error(400, str(e))
        except StoreError as e:
            logger.warning("attn-otel viewer: cannot read trace %s: %s", trace_id, e)
            return error(500, "cannot read this capture from the store (see the server's log)")
        except Exception:  # noqa: BLE001 - one failed view must not say more than that
            logger.exception("attn-otel viewer: %s of trace %s failed", kind, trace_id)
            return error(500, "the viewer failed on this capture (see the server's log)")
        headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
        if kind == "capture":
            return JSONResponse(data, headers=headers)
        headers.update({"Content-Security-Policy": viewer.content_security_policy(served=True),
                        "Referrer-Policy": "no-referrer"})
        return HTMLResponse(viewer.render_page(data, served=True), headers=headers)

    def routes(self) -> list:
        from starlette.routing import Route

        def endpoint(kind):
            async def handle(request):
                return await self._handle(request, kind)

            handle.__name__ = f"attn_otel_view_{kind}"
            return handle

        return [Route(ROUTE + "/{trace_id}", endpoint("page"), methods=["GET"]),
                Route(ROUTE + "/{trace_id}/capture", endpoint("capture"), methods=["GET"]),
                Route(ROUTE + "/{trace_id}/map", endpoint("map"), methods=["GET"])]


def install(app, viewer_app: Viewer | None = None) -> Viewer:
    """Put the viewer's routes first on ``app`` (a Starlette/FastAPI app); idempotent: a second call returns
    the viewer already installed."""
    installed = getattr(app.state, "attn_otel_viewer", None)
    if installed is not None:
        return installed
    viewer_app = viewer_app or Viewer()
    app.router.routes[0:0] = viewer_app.routes()
    app.state.attn_otel_viewer = viewer_app
    return viewer_app
