"""The ``attn-otel`` command: list captures, fetch their maps as NumPy arrays, draw one as a heatmap, write a
viewer page.

Usage::

    attn-otel ls    [--store URL] [--json]
    attn-otel fetch TRACE_ID [--request ID] [--layers 0,3] [--heads 0,1] [-o OUT.npz] [--store URL]
    attn-otel show  TRACE_ID --layer L [--head H] [--request ID] [--rows A:B] [--log]
                    [--tokenizer DIR] [-o MAP.png] [--store URL]
    attn-otel metrics TRACE_ID [--request ID] [--json] [--store URL]
    attn-otel view  TRACE_ID [--request ID] [--tokenizer DIR] [--max-mb MB] [-o OUT.html] [--store URL]
    attn-otel demo  [-o PNG] [--max-tokens N] [--store URL]
    attn-otel gc    [--grace DURATION] [--older-than DURATION] [--dry-run] [--store URL]

The store is ``--store``, else ``ATTN_OTEL_STORE``, else ``./attn-otel-data``.  Output goes to stdout
(``ls``, ``metrics``) or the ``-o`` file; progress and errors go to stderr.  An error is one line,
``attn-otel: error: ...``, and exit status 1; a usage error exits 2.

Adding a subcommand: write ``add_NAME(subparsers, common)`` that calls
``subparsers.add_parser(NAME, parents=[common], ...)`` and ``set_defaults(func=handler)``, where
``handler(args) -> int`` raises :class:`CliError` (or any exception) for a one-line error, and append it
to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from . import demo  # imports vLLM only when it runs
from .config import ATTN_OTEL_STORE, parse_layers
from .reader import Capture, _store_url, list_captures, open_trace
from .store import StoreError, collect_garbage, open_zarr_store, redact_url

PROG = "attn-otel"
MAX_LABELLED_TOKENS = 64
LOG_VMIN = 1e-4


class CliError(Exception):
    """A failure the user can act on; printed as one line, exit status 1."""


# --- argument types (a bad value is a usage error, exit 2) ---------------------------------------------

def _layers_arg(text: str) -> tuple[int, ...] | None:
    try:
        layers = parse_layers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if layers == "auto":
        raise argparse.ArgumentTypeError("'auto' is a capture setting; use 'all' or a list like 0,3")
    return None if layers == "all" else layers


def _heads_arg(text: str) -> tuple[int, ...]:
    try:
        heads = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected heads like 0,1, got {text!r}") from None
    if not heads or heads[0] < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative heads like 0,1, got {text!r}")
    return tuple(heads)


def _rows_arg(text: str) -> tuple[int | None, int | None]:
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected query rows as A:B (either may be left out), got {text!r}")
    return tuple(int(g) if g else None for g in m.groups())  # type: ignore[return-value]


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration_arg(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``1h30m``, ``0``: seconds."""
    compact = text.strip().lower().replace(" ", "")
    if compact == "0":
        return 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise argparse.ArgumentTypeError(f"expected a duration like 30m, 12h, 7d or 1h30m, got {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


# --- helpers shared by the subcommands -----------------------------------------------------------------

def _printable(text: str) -> str:
    """Request ids can come from clients: keep control characters out of terminals and one-line errors."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _iso(created: object) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(created), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def _compact(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 16]`` -> ``"0-3,8,16"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _request_list(caps: Sequence[Capture]) -> str:
    ids = [_printable(c.request_id) for c in caps]
    shown = ", ".join(ids[:10])
    return shown + (f", ... ({len(ids) - 10} more)" if len(ids) > 10 else "")


def _pick_capture(trace_id: str, store: str | None, request: str | None) -> Capture:
    """The capture of ``trace_id`` to fetch or show: the only one, or the one ``--request`` names."""
    caps = open_trace(trace_id, store)
    if request is not None:
        for cap in caps:
            if cap.request_id == request:
                return cap
        raise CliError(f"trace {caps[0].trace_id} has no request {_printable(request)!r}; "
                       f"its requests: {_request_list(caps)}")
    if len(caps) > 1:
        raise CliError(f"trace {caps[0].trace_id} has {len(caps)} captures; choose one with --request: "
                       f"{_request_list(caps)}")
    return caps[0]


def _require_maps(cap: Capture) -> None:
    if not cap.has_maps:
        raise CliError(f"request {_printable(cap.request_id)!r} of trace {cap.trace_id} has metrics only, no "
                       "maps (maps are stored for requests sent with attn_otel=maps or sampled by "
                       "ATTN_OTEL_MAPS_SAMPLE)")


def _check_heads(cap: Capture, heads: Iterable[int]) -> None:
    for h in heads:
        if not 0 <= h < cap.num_heads:
            raise CliError(f"head {h} does not exist (the capture has {cap.num_heads} heads: 0-{cap.num_heads - 1})")


def _read(cap: Capture, what: str, read: Callable[[], np.ndarray]) -> np.ndarray:
    """Run a chunk read; zarr's own errors ("Zstd decompression error") do not say which object failed."""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - any failure past validation is a damaged store object
        raise StoreError(f"{cap.prefix}: cannot read {what} ({type(e).__name__}: {e})") from None


def _info(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


# --- ls ------------------------------------------------------------------------------------------------

def _ls_row(cap: Capture) -> dict[str, object]:
    return {
        "trace_id": cap.trace_id,
        "request_id": cap.request_id,
        "created": _iso(cap.meta.get("created")),
        "num_tokens": cap.num_tokens,
        "prompt_len": cap.prompt_len,
        "layers": cap.layers,
        "num_heads": cap.num_heads,
        "maps": cap.has_maps,
        "token_ids": bool(cap.meta.get("token_ids")),
        "model": cap.meta.get("model", ""),
        "mode": cap.meta.get("mode", ""),
        "finish_reason": cap.finish_reason,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    caps = sorted(list_captures(args.store), key=lambda c: (float(c.meta.get("created") or 0), c.trace_id))
    if args.json:
        # A JSON array with one capture per line: valid for jq, and still greppable.
        rows = [json.dumps(_ls_row(c)) for c in caps]
        sys.stdout.write("[\n" + ",\n".join(rows) + "\n]\n" if rows else "[]\n")
        return 0
    if not caps:
        _info(f"no captures in {_store_url(args.store)}")
        return 0
    header = ("TRACE ID", "REQUEST", "CREATED (UTC)", "TOKENS", "PROMPT", "LAYERS", "HEADS", "MAPS")
    table = [header] + [
        (c.trace_id, _printable(c.request_id), _iso(c.meta.get("created")), str(c.num_tokens), str(c.prompt_len),
         _compact(c.layers), str(c.num_heads), "yes" if c.has_maps else "no")
        for c in caps
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    numeric = {3, 4, 6}
    for line in table:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
    return 0


def add_ls(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("ls", parents=[common], help="list the complete captures in the store",
                              description="One line per complete capture, oldest first.")
    p.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    p.set_defaults(func=cmd_ls)


# --- fetch ---------------------------------------------------------------------------------------------

def _save_npz(path: Path, attn_shape: tuple[int, ...], attn_parts: Iterable[np.ndarray],
              arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed``, except that ``attn`` is written part by part (a fetch of a long request
    holds one T x T map in memory, not all of them), and that the file appears only once complete."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
            with zf.open("attn.npy", "w", force_zip64=True) as f:
                header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
                          "shape": attn_shape}
                np.lib.format.write_array_header_1_0(f, header)
                for part in attn_parts:
                    f.write(np.ascontiguousarray(part, dtype="<f4").tobytes())
            for name, value in arrays.items():
                with zf.open(f"{name}.npy", "w") as f:
                    np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def cmd_fetch(args: argparse.Namespace) -> int:
    cap = _pick_capture(args.trace_id, args.store, args.request)
    _require_maps(cap)
    layers = list(cap.layers) if args.layers is None else list(args.layers)
    for layer in layers:
        cap.layer_index(layer)  # raises for a layer that was not captured
    heads = list(range(cap.num_heads)) if args.heads is None else list(args.heads)
    _check_heads(cap, heads)

    out = Path(args.output or f"{cap.trace_id}.npz")
    T = cap.num_tokens
    arrays = {"layers": np.asarray(layers, dtype=np.int64), "heads": np.asarray(heads, dtype=np.int64),
              "prompt_len": np.asarray(cap.prompt_len, dtype=np.int64)}
    token_ids = _read(cap, "token_ids", lambda: cap.token_ids)
    if token_ids is not None:
        arrays["token_ids"] = token_ids.astype(np.int64)
    parts = (_read(cap, f"layer {layer} head {h}", lambda layer=layer, h=h: cap.maps([layer], [h]))
             for layer in layers for h in heads)
    _save_npz(out, (len(layers), len(heads), T, T), parts, arrays)
    _info(f"wrote {out}: attn [{len(layers)}, {len(heads)}, {T}, {T}] float32, layers {_compact(layers)}, "
          f"request {_printable(cap.request_id)!r}")
    return 0


def add_fetch(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "fetch", parents=[common], help="write a capture's maps to a .npz file",
        description="Write attn float32 [n_layers, n_heads, T, T] (row i = query token i, column j = key token "
                    "j), layers, heads, prompt_len and, where stored, token_ids to a NumPy .npz file.")
    p.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    p.add_argument("--request", metavar="ID", help="the request to fetch when the trace has several captures")
    p.add_argument("--layers", type=_layers_arg, metavar="LIST", help="model layers, e.g. 0,3 (default: all captured)")
    p.add_argument("--heads", type=_heads_arg, metavar="LIST", help="query heads, e.g. 0,1 (default: all)")
    p.add_argument("-o", "--output", metavar="PATH", help="output file (default: TRACE_ID.npz)")
    p.set_defaults(func=cmd_fetch)


# --- show ----------------------------------------------------------------------------------------------

def _label_text(text: str) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$")  # '$' would start mathtext
    text = _printable(text)
    return text if len(text) <= 12 else text[:11] + "…"


def _token_labels(token_ids: np.ndarray, tokenizer: str | None) -> list[str]:
    if tokenizer is not None:
        try:
            import transformers  # noqa: F401
        except Exception as e:  # noqa: BLE001 - a broken transformers install must not stop the plot
            _info(f"cannot import transformers ({type(e).__name__}); labelling tokens by id")
        else:
            from . import viewer

            try:
                tok = viewer.load_tokenizer(tokenizer)  # this machine's files only, as the viewer's
            except ValueError as e:
                raise CliError(str(e)) from None
            return [_label_text(tok.decode([int(t)])) for t in token_ids]
    return [str(int(t)) for t in token_ids]


def _head_mean(attn, li: int, start: int, stop: int) -> np.ndarray:
    """Mean over heads, one head at a time: a long request's heads together would not fit in memory."""
    total = np.zeros((stop - start, stop), dtype=np.float32)
    for h in range(attn.shape[1]):
        total += attn[li, h, start:stop, :stop]
    return total / attn.shape[1]


def cmd_show(args: argparse.Namespace) -> int:
    cap = _pick_capture(args.trace_id, args.store, args.request)
    _require_maps(cap)
    li = cap.layer_index(args.layer)
    if args.head is not None:
        _check_heads(cap, [args.head])
    T = cap.num_tokens
    first, last = args.rows or (None, None)
    start, stop = first or 0, T if last is None else min(last, T)
    if start >= stop:
        shown = f"{'' if first is None else first}:{'' if last is None else last}"
        raise CliError(f"--rows {shown} selects no query rows (the capture has {T} tokens)")

    # Causal: rows start..stop-1 see keys 0..stop-1 at most, so the columns past stop are all zero.
    if args.head is not None:
        data = _read(cap, f"layer {args.layer} head {args.head}",
                     lambda: np.asarray(cap.attn[li, args.head, start:stop, :stop], dtype=np.float32))
        what = f"head {args.head}"
    else:
        data = _read(cap, f"layer {args.layer}", lambda: _head_mean(cap.attn, li, start, stop))
        what = f"mean over {cap.num_heads} heads"
    query = np.arange(start, stop)[:, None]
    key = np.arange(stop)[None, :]
    future = key > query
    if args.log:
        data = np.maximum(data, LOG_VMIN)  # a visible key with ~0 weight is "very little", not blank
    data = np.ma.masked_where(future, data)

    labels = None
    token_ids = _read(cap, "token_ids", lambda: cap.token_ids)
    if token_ids is not None and stop <= MAX_LABELLED_TOKENS:
        labels = _token_labels(token_ids[:stop], args.tokenizer)
    elif args.tokenizer is not None:
        why = "no token ids stored" if token_ids is None else f"{stop} > {MAX_LABELLED_TOKENS} tokens"
        _info(f"not labelling tokens: {why}")

    title = (f"trace {cap.trace_id}\nrequest {_printable(cap.request_id)}  ·  layer {args.layer}  ·  {what}"
             + (f"  ·  query rows {start}:{stop}" if (start, stop) != (0, T) else ""))
    head_suffix = f"-head{args.head}" if args.head is not None else ""
    out = Path(args.output or f"{cap.trace_id}-layer{args.layer}{head_suffix}.png")
    _plot(out, data, start, stop, cap.prompt_len, labels, title, args.log)
    _info(f"wrote {out}")
    return 0


def _plot(out: Path, data: np.ma.MaskedArray, start: int, stop: int, prompt_len: int, labels: list[str] | None,
          title: str, log: bool) -> None:
    import warnings

    import matplotlib
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    from matplotlib.ticker import MaxNLocator

    rows, cols = data.shape
    vmax = max(float(data.max()) if data.count() else 1.0, LOG_VMIN * 10)
    norm = LogNorm(vmin=LOG_VMIN, vmax=vmax, clip=True) if log else Normalize(vmin=0.0, vmax=vmax)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")

    fig = Figure(figsize=(9.5, 8.5), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(data, cmap=cmap, norm=norm, extent=(-0.5, cols - 0.5, stop - 0.5, start - 0.5),
                   aspect="equal" if rows * 4 >= cols else "auto",  # a thin band of rows stays readable
                   interpolation="nearest" if cols <= 512 else "antialiased")
    fig.colorbar(im, ax=ax, shrink=0.85, label="attention weight" + (" (log scale)" if log else ""))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")

    if 0 < prompt_len < stop:
        boundary = prompt_len - 0.5
        ax.axvline(boundary, color="red", linewidth=1, linestyle="--",
                   label=f"prompt | generated (prompt_len {prompt_len})")
        if start < prompt_len:
            ax.axhline(boundary, color="red", linewidth=1, linestyle="--")
        fig.legend(loc="outside lower right", fontsize=8)  # outside: a band of rows has no blank corner

    if labels is not None:
        size = 8 if cols <= 32 else 6
        ax.set_xticks(range(cols), [f"{j}: {labels[j]}" for j in range(cols)], rotation=90, fontsize=size)
        ax.set_yticks(range(start, stop), [f"{i}: {labels[i]}" for i in range(start, stop)], fontsize=size)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # glyphs missing from the font for some decoded tokens
        fig.savefig(out, format="png")


def add_show(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "show", parents=[common], help="draw one layer's map as a heatmap PNG",
        description="Draw the attention map of one captured layer (one head, or the mean over heads) as a "
                    "PNG heatmap: query tokens down, key tokens across, the prompt/generated boundary dashed.")
    p.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    p.add_argument("--layer", type=_non_negative, required=True, metavar="L", help="model layer (must be captured)")
    p.add_argument("--head", type=_non_negative, metavar="H", help="query head (default: mean over heads)")
    p.add_argument("--request", metavar="ID", help="the request to draw when the trace has several captures")
    p.add_argument("--rows", type=_rows_arg, metavar="A:B", help="only query rows A..B-1")
    p.add_argument("--log", action="store_true", help=f"log colour scale (from {LOG_VMIN:g})")
    p.add_argument("--tokenizer", metavar="DIR",
                   help=f"HF tokenizer folder: label axes with decoded tokens (up to {MAX_LABELLED_TOKENS} tokens)")
    p.add_argument("-o", "--output", metavar="PATH", help="output file (default: TRACE_ID-layerL[-headH].png)")
    p.set_defaults(func=cmd_show)


# --- metrics -------------------------------------------------------------------------------------------

# (part, column header, metric) of the table; "{k}" is the capture's sink_tokens.
METRIC_COLUMNS = (
    ("prompt", "ENTROPY_NORM", "entropy_norm"),
    ("prompt", "SINK[0]", "sink_mass_first"),
    ("prompt", "SINK[0:{k}]", "sink_mass_k"),
    ("prompt", "VISION", "vision_share"),
    ("generated", "ENTROPY_NORM", "entropy_norm"),
    ("generated", "LOOKBACK", "lookback_ratio"),
)
# the learned sink's share (gpt-oss), after each part's columns, for a capture of a model with learned sinks only
LEARNED_SINK_COLUMNS = (("prompt", "LEARNED_SINK", "learned_sink_mass"),
                        ("generated", "LEARNED_SINK", "learned_sink_mass"))


def _summary(cap: Capture) -> dict:
    from .metrics import summarize

    if not cap.has_row_metrics and cap.meta.get("summary_metrics") is not None:
        return _read(cap, "summary", cap.summary)
    per_row = _read(cap, "metrics", lambda: cap.metrics)
    if not per_row:
        raise CliError(f"request {_printable(cap.request_id)!r} of trace {cap.trace_id} has no stored metrics")
    try:
        return summarize(per_row, cap.prompt_len)
    except ValueError as e:
        raise StoreError(f"{cap.prefix}: stored metrics are not per-row metrics ({e})") from None


def _cell(stats: dict | None, li: int) -> str:
    if stats is None:
        return "-"
    value = float(stats["layer_mean"][li])
    return "-" if np.isnan(value) else f"{value:.3f}"


def _metrics_table(cap: Capture, summary: dict) -> list[str]:
    k = cap.meta.get("sink_tokens", 4)
    columns = list(METRIC_COLUMNS)
    for col in LEARNED_SINK_COLUMNS:
        if summary.get(col[0], {}).get(col[2]) is not None:
            columns.insert(max(i for i, c in enumerate(columns) if c[0] == col[0]) + 1, col)
    headers = ["LAYER"] + [title.format(k=k) for _, title, _ in columns]
    rows = [[str(layer)] + [_cell(summary[part][name], li) for part, _, name in columns]
            for li, layer in enumerate(cap.layers)]
    widths = [max(len(line[i]) for line in [headers, *rows]) for i in range(len(headers))]
    groups = []
    for part in ("prompt", "generated"):
        span = [w for (p, _, _), w in zip(columns, widths[1:]) if p == part]
        groups.append(f" {part} ".center(sum(span) + 2 * (len(span) - 1), "-"))
    lines = [f"trace {cap.trace_id}  request {_printable(cap.request_id)!r}  T={cap.num_tokens}  "
             f"prompt_len={cap.prompt_len}  (means over {cap.num_heads} heads)",
             " " * widths[0] + "  " + "  ".join(groups)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [headers, *rows]]
    return lines


def cmd_metrics(args: argparse.Namespace) -> int:
    from .metrics import to_json

    caps = [_pick_capture(args.trace_id, args.store, args.request)] if args.request is not None \
        else open_trace(args.trace_id, args.store)
    summaries = [(cap, _summary(cap)) for cap in caps]  # every capture readable before anything is printed
    if args.json:
        docs = [to_json(cap, summary) for cap, summary in summaries]
        print(json.dumps(docs[0] if len(docs) == 1 else docs, allow_nan=False))
        return 0
    blocks = ["\n".join(_metrics_table(cap, summary)) for cap, summary in summaries]
    print("\n\n".join(blocks))
    return 0


def add_metrics(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "metrics", parents=[common], help="print a capture's attention-health metrics per layer",
        description="Per layer, the mean over heads of each metric over the prompt rows and over the generated "
                    "rows: normalised entropy, attention on token 0 and on the first k sink tokens, vision "
                    "share ('-' for a text-only request) and lookback ratio.  One table per capture of the "
                    "trace; with --json, per-(layer, head) means: one object, or a list for several captures.")
    p.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    p.add_argument("--request", metavar="ID", help="only this request's capture (default: every capture of the trace)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_metrics)


# --- view ----------------------------------------------------------------------------------------------

def cmd_view(args: argparse.Namespace) -> int:
    from . import viewer

    cap = _pick_capture(args.trace_id, args.store, args.request)
    others = [c.request_id for c in open_trace(cap.trace_id, args.store)]
    tokenizer = None
    if args.tokenizer is not None and not cap.meta.get("token_ids"):
        _info("not labelling tokens: no token ids stored (ATTN_OTEL_STORE_TOKENS=1 stores them)")
    elif args.tokenizer is not None:
        tokenizer = viewer.load_tokenizer(args.tokenizer)
    page, report = _read(cap, "maps", lambda: viewer.build_file(
        cap, tokenizer=tokenizer, max_bytes=int(args.max_mb * (1 << 20)), requests=others))
    out = Path(args.output or f"{cap.trace_id}.html")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    if not cap.has_maps:
        _info(f"request {_printable(cap.request_id)!r} has metrics only, no maps: the page shows its metrics")
    elif report["left_out"]:
        _info(f"left out {len(report['left_out'])} of {len(report['left_out']) + len(report['embedded'])} maps "
              f"(over --max-mb {args.max_mb:g}); the page says which")
    _info(f"wrote {out} ({out.stat().st_size / (1 << 20):.1f} MiB)")
    return 0


def _positive_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive size in MB, got {text!r}")
    return value


def add_view(subparsers, common: argparse.ArgumentParser) -> None:
    from .viewer import DEFAULT_MAX_MB

    p = subparsers.add_parser(
        "view", parents=[common], help="write a capture as a self-contained HTML viewer page",
        description="Write one capture as an HTML page that opens offline in a browser: layer and head pickers "
                    "(and the mean over heads), a log-scale toggle, per-row and per-layer metric strips, and a "
                    "click on a query row shows its attention over the text.  The vLLM server with ATTN_OTEL=1 "
                    "serves the same page at /attn-otel/view/TRACE_ID (docs/viewer.md).")
    p.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    p.add_argument("--request", metavar="ID", help="the request to show when the trace has several captures")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer folder: decoded tokens on the axes and in the "
                   "text (needs stored token ids); without it, token ids")
    p.add_argument("--max-mb", type=_positive_mb, default=float(DEFAULT_MAX_MB), metavar="MB",
                   help="embed maps (head means first, then heads) up to this many MB before compression "
                        "(default %(default)g; a 4k-token map is 8 MB)")
    p.add_argument("-o", "--output", metavar="PATH", help="output file (default: TRACE_ID.html)")
    p.set_defaults(func=cmd_view)


# --- gc ------------------------------------------------------------------------------------------------

DEFAULT_GRACE = "10m"


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def cmd_gc(args: argparse.Namespace) -> int:
    store = open_zarr_store(_store_url(args.store), read_only=True)  # a missing store is an error, not created
    if not args.dry_run:
        store = store.with_read_only(False)
    removed = collect_garbage(store, grace_s=args.grace, older_than_s=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for cap in removed:
        kind = "complete" if cap.complete else "partial"
        print(f"{verb} {kind:8} {cap.prefix}  {cap.objects} objects  {_size(cap.nbytes)}  {_age(cap.age_s)} old")
    partial = sum(not c.complete for c in removed)
    total = sum(c.nbytes for c in removed)
    print(f"{verb} {len(removed)} captures ({partial} partial, {len(removed) - partial} complete), "
          f"{'would free' if args.dry_run else 'freed'} {total} bytes ({_size(total)}) "
          f"in {redact_url(_store_url(args.store))}")
    return 0


def add_gc(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "gc", parents=[common], help="delete partial captures (and, with --older-than, old complete ones)",
        description="Delete what writers killed mid-capture left behind: captures without a COMPLETE marker "
                    "whose newest object is older than --grace (so a capture being written now is kept).  With "
                    "--older-than, also delete complete captures made longer ago than that.  Prints one line "
                    "per capture and a total of bytes freed.  Works on local and s3:// stores.")
    p.add_argument("--grace", type=_duration_arg, default=_duration_arg(DEFAULT_GRACE), metavar="DURATION",
                   help=f"keep partial captures written to within this long (default {DEFAULT_GRACE})")
    p.add_argument("--older-than", type=_duration_arg, metavar="DURATION",
                   help="also delete complete captures older than this, e.g. 7d, 12h, 30m")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p.set_defaults(func=cmd_gc)


# --- entry point ---------------------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    got = demo.run(args)  # serves SmolLM2 with capture on; prints the requests and their trace ids
    if got is None:
        return 1
    shown, store, model = got
    layer = shown.layers[len(shown.layers) // 2]
    png = Path(args.output)
    print(f"[4/4] heatmap of trace {shown.trace_id}, layer {layer} -> {png}", file=sys.stderr, flush=True)
    rc = main(["show", shown.trace_id, "--layer", str(layer), "--store", store, "--tokenizer", model, "-o", str(png)])
    print()
    print("next:")
    print(f"  .venv/bin/attn-otel ls --store {store}")
    print(f"  .venv/bin/attn-otel fetch {shown.trace_id} -o out.npz --store {store}")
    print(f"  .venv/bin/attn-otel show {shown.trace_id} --layer {shown.layers[-1]} --log -o map.png --store {store}")
    return rc


def add_demo(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("demo", parents=[common], help="serve SmolLM2 with capture on, store and draw maps",
                              description=demo.__doc__)
    p.add_argument("-o", "--output", default="attn-otel-demo.png", help="heatmap PNG (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per request")
    p.set_defaults(func=cmd_demo)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None]] = [
    add_ls, add_fetch, add_show, add_metrics, add_view, add_demo, add_gc,
]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="URL", help="path, file://PATH or s3://bucket/prefix "
                        f"(default: ${ATTN_OTEL_STORE}, else ./attn-otel-data)")
    parser = argparse.ArgumentParser(prog=PROG, description="Fetch and inspect attention captured by attn-otel.")
    subparsers = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2) and --help (0); returned so that callers in-process see them
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `attn-otel ls | head`: the reader went away, which is not an error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit flush
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - the contract is one line, never a traceback
        known = isinstance(e, (CliError, StoreError, LookupError, ValueError, OSError))
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if not known:
            message = f"{type(e).__name__}: {message}"
        print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
