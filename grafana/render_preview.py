"""A screenshot-like picture of the "Attention health" dashboard's outlier walk, drawn with matplotlib from a
live Prometheus (no Grafana needed), and the ``attn-otel show`` map of the outlier's trace.

Usage
-----
::

    python grafana/render_preview.py --prometheus http://127.0.0.1:9090 --store ./attn-otel-data \\
        [--job attn-otel] [--metric sink_mass_first] [--minutes 30 | --start T [--end T]] [--out-dir docs/img]

writes ``{out-dir}/dashboard-outlier.png`` (the metric's per-layer heatmap over time, as the dashboard's
heatmap panel queries it, above its "p50 and p99 per layer, exemplars" panel with the exemplar dots and the
outlier circled) and ``{out-dir}/outlier-map.png`` (``attn-otel show TRACE_ID --layer L`` of the outlier's
trace), and prints the outlier's trace id, layer and value.  The queries are the committed dashboard's
own panel queries with Grafana's variables filled in (job as given, every other variable "All").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana import generate  # noqa: E402


def _api(url: str, path: str, **params) -> dict:
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=60) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body}")
    return body["data"]


def _panel(model: dict, kind: str, metric: str) -> dict:
    for p, _ in generate.iter_targets(model):
        if p["type"] == kind and any(f"attn_otel_{metric}_" in t["expr"] for t in p["targets"]):
            return p
    raise KeyError(f"no {kind} panel for {metric}")


def collect(prometheus: str, job: str, metric: str, start: float, end: float, step: float,
            rate_interval: float = 15.0) -> dict:
    """The heatmap panel's series and the outlier panel's series and exemplars over [start, end]."""
    model = generate.build()["attention-health.json"]
    variables = {"job": generate.regex_value([job]), "instance": ".*", "model": ".*", "layer": ".*"}
    rate = f"{int(max(4 * step, rate_interval))}s"  # Grafana: max(4 x scrape interval, step + scrape)

    def run(expr: str) -> list[dict]:
        q = generate.interpolate(expr, variables, rate_interval=rate, range_=f"{int(end - start)}s")
        return _api(prometheus, "query_range", query=q, start=start, end=end, step=step)["result"]

    heat = _panel(model, "heatmap", metric)
    outl = _panel(model, "timeseries", metric)
    exemplars = []
    for t in outl["targets"]:
        q = generate.interpolate(t["expr"], variables, rate_interval=rate)
        for series in _api(prometheus, "query_exemplars", query=q, start=start, end=end):
            for e in series["exemplars"]:
                exemplars.append({"layer": series["seriesLabels"].get("layer"), "trace_id": e["labels"]["trace_id"],
                                  "value": float(e["value"]), "time": float(e["timestamp"])})
    unique = {(e["trace_id"], e["layer"], e["time"]): e for e in exemplars}
    return {"heatmap": run(heat["targets"][0]["expr"]), "heatmap_title": heat["title"],
            "quantiles": {t["legendFormat"]: run(t["expr"]) for t in outl["targets"]}, "outlier_title": outl["title"],
            "exemplars": sorted(unique.values(), key=lambda e: e["time"])}


def draw_dashboard(data: dict, out: Path, metric: str, outlier: dict) -> None:
    import datetime as dt

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    import numpy as np

    bg, fg, grid = "#181b1f", "#d8d9da", "#2c3235"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.1]})
    fig.patch.set_facecolor(bg)
    series = sorted(data["heatmap"], key=lambda s: int(s["metric"]["layer"]))
    layers = [s["metric"]["layer"] for s in series]
    times = sorted({float(v[0]) for s in series for v in s["values"]})
    grid_v = np.full((len(layers), len(times)), np.nan)
    t_index = {t: i for i, t in enumerate(times)}
    for r, s in enumerate(series):
        for t, v in s["values"]:
            grid_v[r, t_index[float(t)]] = float(v)
    to_dt = lambda ts: [dt.datetime.fromtimestamp(t) for t in ts]  # noqa: E731
    if times:
        edges = np.concatenate([[times[0] - (times[1] - times[0] if len(times) > 1 else 1)], times])
        mesh = ax1.pcolormesh(mdates.date2num(to_dt(edges)), np.arange(len(layers) + 1),
                              np.ma.masked_invalid(grid_v), cmap="viridis", vmin=0, vmax=1, shading="flat")
        cb = fig.colorbar(mesh, ax=ax1, pad=0.01)
        cb.ax.tick_params(colors=fg)
        cb.outline.set_edgecolor(grid)
    ax1.set_yticks(np.arange(len(layers)) + 0.5, layers)
    ax1.set_ylabel("layer", color=fg)
    ax1.set_title(data["heatmap_title"] + " - mean per layer (heatmap panel)", color=fg, loc="left", fontsize=11)

    colors = plt.cm.tab10.colors
    layer_color = {layer: colors[i % len(colors)] for i, layer in enumerate(layers)}
    for legend, result in data["quantiles"].items():
        dashed = legend.startswith("p50")
        for s in sorted(result, key=lambda s: int(s["metric"].get("layer", 0))):
            layer = s["metric"].get("layer")
            # a gap where no capture fell in the window (NaN), as Grafana draws it
            ts, vs = zip(*[(float(t), float(v)) for t, v in s["values"]])
            if np.isfinite(vs).any():
                ax2.plot(to_dt(ts), vs, "--" if dashed else "-", lw=1 if dashed else 1.6,
                         color=layer_color.get(layer, fg), alpha=0.6 if dashed else 0.95,
                         label=legend.replace("{{layer}}", str(layer)))
    for e in data["exemplars"]:
        ax2.scatter(to_dt([e["time"]]), [e["value"]], s=28, marker="D", color=layer_color.get(e["layer"], fg),
                    edgecolor="white", linewidth=0.6, zorder=3)
    ax2.scatter(to_dt([outlier["time"]]), [outlier["value"]], s=260, facecolors="none", edgecolors="#ff5286",
                linewidth=2.2, zorder=4)
    ax2.annotate(f"exemplar  trace_id={outlier['trace_id']}\nlayer {outlier['layer']}, {metric} = "
                 f"{outlier['value']:.3f}\n-> attn-otel show {outlier['trace_id'][:8]}... --layer {outlier['layer']}",
                 xy=(mdates.date2num(to_dt([outlier["time"]])[0]), outlier["value"]), xytext=(0.01, 0.97),
                 textcoords="axes fraction", va="top", color=fg, fontsize=9, family="monospace",
                 bbox={"boxstyle": "round", "fc": "#22252b", "ec": "#ff5286"},
                 arrowprops={"arrowstyle": "->", "color": "#ff5286"})
    ax2.set_ylim(0, 1.15)
    ax2.set_ylabel(metric, color=fg)
    ax2.set_title(data["outlier_title"] + " (dots: exemplars)", color=fg, loc="left", fontsize=11)
    leg = ax2.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    for text in leg.get_texts():
        text.set_color(fg)
    ax2.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    for ax in (ax1, ax2):
        ax.set_facecolor(bg)
        ax.tick_params(colors=fg)
        for spine in ax.spines.values():
            spine.set_color(grid)
    ax2.grid(color=grid, lw=0.6)
    fig.suptitle("attn-otel: attention health (rendered from Prometheus by grafana/render_preview.py)", color=fg,
                 x=0.01, ha="left", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, facecolor=bg)
    plt.close(fig)


def pick_outlier(exemplars: list[dict], metric: str) -> dict:
    tail = {name: t for name, _, t in generate.HEALTH_METRICS}[metric]
    if not exemplars:
        raise SystemExit(f"no exemplars for attn_otel_{metric} in the range: scrape /attn-otel/metrics with "
                         "--enable-feature=exemplar-storage")
    return (max if tail == "high" else min)(exemplars, key=lambda e: e["value"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", required=True, metavar="URL")
    parser.add_argument("--store", required=True, metavar="URL", help="the attn-otel store the server writes")
    parser.add_argument("--job", default="attn-otel", help="scrape job of /attn-otel/metrics (default: %(default)s)")
    parser.add_argument("--metric", default="sink_mass_first", choices=[m for m, _, _ in generate.HEALTH_METRICS])
    parser.add_argument("--minutes", type=float, default=30.0, help="time range ending now (default: %(default)s)")
    parser.add_argument("--start", type=float, help="range start, unix seconds (overrides --minutes)")
    parser.add_argument("--end", type=float, help="range end, unix seconds (default: now)")
    parser.add_argument("--rate-interval", type=float, default=15.0, metavar="S",
                        help="least $__rate_interval in seconds (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - 60 * args.minutes
    step = max(1.0, round((end - start) / 240))
    data = collect(args.prometheus, args.job, args.metric, start, end, step, args.rate_interval)
    outlier = pick_outlier(data["exemplars"], args.metric)
    draw_dashboard(data, args.out_dir / "dashboard-outlier.png", args.metric, outlier)
    from attn_otel import cli

    rc = cli.main(["show", outlier["trace_id"], "--layer", str(outlier["layer"]), "--store", str(args.store),
                   "-o", str(args.out_dir / "outlier-map.png")])
    print(json.dumps(outlier))
    return rc


if __name__ == "__main__":
    sys.exit(main())
