"""The attn-otel viewer: one capture's attention in a browser, as a page of plain JavaScript and a canvas.

The page (``viewer_assets/``: no library, no CDN, nothing fetched from anywhere else) shows one layer's map
at a time, the mean over heads or one head, query tokens down and key tokens across, the prompt|generated
boundary dashed; a log-scale toggle; per-row metric strips beside the map and per-layer metric strips below
it (normalised entropy, sink mass, vision share, lookback ratio); a click on a query row shows that row's
attention over the text (the stored tokens, decoded where a tokenizer is at hand, else positions).

It comes two ways, from the same page and the same data:

- ``attn-otel view TRACE_ID -o out.html``: :func:`build_file` writes one self-contained HTML file that embeds
  what it shows; a Content-Security-Policy forbids it any connection, so it opens offline.  Maps are embedded
  in order, the mean over heads of each layer first, then each layer's heads, until they reach ``max_bytes``
  (a 4k-token map is 8 MB): the page names those left out.
- The vLLM API server (``ATTN_OTEL=1``) serves the page at ``/attn-otel/view/{trace_id}``
  (:mod:`attn_otel.viewer_routes`), which fetches each map when it is first shown: a view reads only the
  Zarr chunks of the layer (and head) on screen.

Maps travel as *codes*: uint8, 0 for a weight under :data:`LOG_FLOOR` (and for 0), else 1-255 on a log scale
from :data:`LOG_FLOOR` to 1 (one code is a factor 1.056: weights are drawn to within about 3%); only the
causal part, query row i's keys 0..i row after row (``T * (T + 1) / 2`` bytes), zlib-compressed.  The page
decompresses them with the browser's own ``DecompressionStream``.  Per-row metrics travel as float16.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import zlib
from importlib import resources
from typing import Any, Iterable, Sequence

import numpy as np

from .metrics import summarize
from .store import ROWS_PER_CHUNK

LOG_FLOOR = 1e-6
_STEPS = 254  # codes 1..255 span LOG_FLOOR..1
DEFAULT_MAX_MB = 64
PAGE_VERSION = 1
# per-row strips beside the map, in this order (each in [0, 1]; the vision share only where an image was seen,
# and the learned sink's share only for a model with learned sinks)
STRIP_METRICS = ("entropy_norm", "sink_mass_first", "sink_mass_k", "vision_share", "lookback_ratio",
                 "learned_sink_mass")
# per-layer strips: (part, metric), the columns of `attn-otel metrics`
OVERVIEW = (("prompt", "entropy_norm"), ("prompt", "sink_mass_first"), ("prompt", "sink_mass_k"),
            ("prompt", "vision_share"), ("prompt", "learned_sink_mass"), ("generated", "entropy_norm"),
            ("generated", "lookback_ratio"))
MEAN = "mean"  # the head of the mean over heads, in map ids and the served route's ``head=``
VIEW_ROUTE = "/attn-otel/view"  # on vLLM's API server; grafana/generate.py links exemplars here


def view_path(trace_id: str, request_id: str | None = None) -> str:
    """The served page of a capture, from the server's root: ``/attn-otel/view/{trace_id}?request=...``."""
    from urllib.parse import quote

    return f"{VIEW_ROUTE}/{trace_id}" + ("" if request_id is None else f"?request={quote(str(request_id), safe='')}")


# --- maps as codes ------------------------------------------------------------------------------------

def quantize(values: np.ndarray) -> np.ndarray:
    """Attention weights -> uint8 codes (see the module docstring)."""
    values = np.asarray(values, dtype=np.float32)
    codes = np.zeros(values.shape, dtype=np.uint8)
    seen = values >= LOG_FLOOR
    steps = (np.log10(np.minimum(values[seen], 1.0)) - np.log10(LOG_FLOOR)) * (_STEPS / -np.log10(LOG_FLOOR))
    codes[seen] = 1 + np.rint(steps).astype(np.uint8)
    return codes


def dequantize(codes: np.ndarray) -> np.ndarray:
    """uint8 codes -> the float32 weights they stand for (0 for code 0)."""
    codes = np.asarray(codes)
    values = 10.0 ** (np.log10(LOG_FLOOR) * (1 - (codes.astype(np.float32) - 1) / _STEPS))
    return np.where(codes == 0, 0.0, values).astype(np.float32)


def packed_size(num_tokens: int) -> int:
    return num_tokens * (num_tokens + 1) // 2


def unpack(packed: np.ndarray, num_tokens: int) -> np.ndarray:
    """Packed causal rows -> a ``[T, T]`` array (zeros above the diagonal); for tests and tools."""
    out = np.zeros((num_tokens, num_tokens), dtype=packed.dtype)
    for i in range(num_tokens):
        out[i, :i + 1] = packed[i * (i + 1) // 2:(i + 1) * (i + 2) // 2]
    return out


def map_id(layer_index: int, head: int | None) -> str:
    return f"{layer_index}-{MEAN if head is None else head}"


def layer_codes(cap, layer_index: int, heads: Sequence[int], mean: bool) -> dict[str, np.ndarray]:
    """Packed codes of one layer's maps: each of ``heads``, and with ``mean`` the mean over all heads.
    Reads the layer's chunks one band of query rows at a time (the store's chunk rows), each chunk once:
    every head's for the mean (or all heads), else only those of ``heads``."""
    T, H = cap.num_tokens, cap.num_heads
    attn = cap.attn
    every = mean or sorted(heads) == list(range(H))
    wanted = [(map_id(layer_index, h), h if every else j) for j, h in enumerate(heads)]
    if mean:
        wanted.append((map_id(layer_index, None), None))
    out = {key: np.empty(packed_size(T), dtype=np.uint8) for key, _ in wanted}
    for a in range(0, T, ROWS_PER_CHUNK):
        b = min(T, a + ROWS_PER_CHUNK)
        rows, keys = slice(a, b), slice(0, b)  # causal: rows a..b-1 see keys 0..b-1 at most
        if every:
            band = cap._read("attn", attn, (layer_index, slice(None), rows, keys))  # [heads, rows, keys] f16
        else:
            band = np.stack([cap._read("attn", attn, (layer_index, int(h), rows, keys)) for h in heads])
        for key, pos in wanted:
            codes = quantize(band.mean(axis=0, dtype=np.float32) if pos is None else band[pos])
            packed = out[key]
            for k in range(b - a):
                i = a + k
                packed[i * (i + 1) // 2:(i + 1) * (i + 2) // 2] = codes[k, :i + 1]
    return out


def compress(codes: np.ndarray, level: int = 1) -> bytes:
    return zlib.compress(np.ascontiguousarray(codes, dtype=np.uint8).tobytes(), level)


# --- the page's data ----------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer from a folder (or hub id already cached); ValueError naming why not.  Never
    from the network: a served viewer labels its own model's tokens, whose files vLLM already has, and a hub
    lookup from a machine that cannot reach the hub retries for most of a minute (``local_files_only``)."""
    try:
        from transformers import AutoTokenizer
    except Exception as e:  # noqa: BLE001 - a broken transformers install: say so, once, as one line
        raise ValueError(f"cannot import transformers to decode tokens ({type(e).__name__}: {e})") from None
    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load a tokenizer from {os.fspath(path)}: {e}") from None


def token_labels(cap, tokenizer=None) -> tuple[list[str] | None, str]:
    """``(labels, kind)``: each stored token decoded (kind ``tokens``) with a tokenizer (an object with
    ``batch_decode``, or a folder), the token ids as text (``ids``) without one, or None (``positions``)
    when the capture stored no token ids (the default: token ids are content)."""
    ids = cap.token_ids
    if ids is None:
        return None, "positions"
    if tokenizer is None:
        return [str(int(t)) for t in ids], "ids"
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    return [str(s) for s in tokenizer.batch_decode([[int(t)] for t in ids])], "tokens"


def _floats(values: Iterable[float]) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]


def _f16(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f2").tobytes()).decode("ascii")


def page_data(cap, labels: list[str] | None, label_kind: str, requests: Sequence[str] = ()) -> dict[str, Any]:
    """What the page needs besides the maps, as JSON: the capture's metadata, token labels, the per-row
    metrics of :data:`STRIP_METRICS` (float16, base64, ``[layers, heads, T]``) and the per-(layer, head)
    means of :data:`OVERVIEW`."""
    rows = cap.row_metrics(STRIP_METRICS)
    if cap.has_row_metrics:
        summary = summarize(cap.row_metrics(), cap.prompt_len)
    elif cap.meta.get("summary_metrics") is not None:
        summary = cap.summary()
    else:
        summary = None
    overview = {}
    for part, name in OVERVIEW:
        stats = None if summary is None else summary[part].get(name)
        overview[f"{part}.{name}"] = None if stats is None else {
            "layer_mean": _floats(stats["layer_mean"]), "mean": [_floats(m) for m in stats["mean"]]}
    created = cap.meta.get("created")
    return {
        "version": PAGE_VERSION, "trace_id": cap.trace_id, "request_id": cap.request_id,
        "requests": [str(r) for r in requests] or [cap.request_id], "model": cap.model,
        "num_tokens": cap.num_tokens, "prompt_len": cap.prompt_len, "layers": cap.layers,
        "num_heads": cap.num_heads, "has_maps": cap.has_maps, "finish_reason": cap.finish_reason,
        "created": float(created) if isinstance(created, (int, float)) else None,
        "sink_tokens": int(cap.meta.get("sink_tokens", 4)), "labels": labels, "label_kind": label_kind,
        "row_metrics": {name: _f16(value) for name, value in rows.items()},
        "overview": overview, "log_floor": LOG_FLOOR, "steps": _STEPS,
    }


# --- the page -----------------------------------------------------------------------------------------

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
        "connect-src {connect}; base-uri 'none'; form-action 'none'")


def content_security_policy(served: bool) -> str:
    """The file may connect nowhere; the served page only to its own origin (its map requests)."""
    return _CSP.format(connect="'self'" if served else "'none'")


def _asset(name: str) -> str:
    return (resources.files("attn_otel") / "viewer_assets" / name).read_text(encoding="utf-8")


def render_page(data: dict[str, Any], maps: dict[str, bytes] | None = None, *, served: bool = False) -> str:
    """The HTML page: ``data`` (:func:`page_data` plus ``maps``, where they come from) as JSON and, for a file,
    each embedded map (compressed codes, by :func:`map_id`) as base64, with the page's script and style."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")  # no "</script>"
    blobs = "".join(f'<script type="application/octet-stream" id="attn-otel-map-{key}">'
                    f'{base64.b64encode(blob).decode("ascii")}</script>\n' for key, blob in (maps or {}).items())
    parts = {
        "TITLE": html.escape(f"attn-otel · trace {data['trace_id']} · {data['request_id']}"),
        "CSP": html.escape(content_security_policy(served)),
        "STYLE": _asset("viewer.css"), "SCRIPT": _asset("viewer.js"), "DATA": text, "MAPS": blobs,
    }
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], _asset("viewer.html"))


def build_file(cap, *, tokenizer=None, max_bytes: int = DEFAULT_MAX_MB << 20,
               requests: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """The self-contained page of one capture, and what it embeds (``embedded``/``left_out`` map ids,
    ``map_bytes``: packed bytes before compression).  The mean over heads of the first layer is always
    embedded; the rest while the packed maps stay within ``max_bytes``."""
    labels, kind = token_labels(cap, tokenizer)
    data = page_data(cap, labels, kind, requests)
    maps: dict[str, bytes] = {}
    left_out: list[str] = []
    used, size = 0, packed_size(cap.num_tokens)
    if cap.has_maps:
        L, H = len(cap.layers), cap.num_heads
        fits = max(1, max_bytes // max(size, 1))  # maps in the budget, at least one
        means = list(range(min(L, fits)))
        per_head = max(0, (fits - len(means)) // H) if len(means) == L else 0  # whole layers of heads
        left_out = [map_id(li, None) for li in range(len(means), L)]
        for li in range(L):
            heads = list(range(H)) if li < per_head else []
            left_out += [map_id(li, h) for h in range(H) if li >= per_head]
            if li < len(means) or heads:
                for key, codes in layer_codes(cap, li, heads, mean=li < len(means)).items():
                    maps[key] = compress(codes, 6)
                    used += size
    data["maps"] = {"source": "file", "embedded": sorted(maps), "left_out": left_out,
                    "limit_mb": round(max_bytes / (1 << 20), 1)}
    report = {"embedded": sorted(maps), "left_out": left_out, "map_bytes": used,
              "compressed_bytes": sum(len(b) for b in maps.values())}
    return render_page(data, maps), report
