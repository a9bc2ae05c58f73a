"""The online A/B's figures, from its raw files: one row a server (medians of its runs, ratios to capture off
in the same call), each configuration's runs pooled, the ratios paired by seed (every server of a call runs
the same arrival sequences, seeds 0..R-1, so run k of a server and run k of off met the same load), and a plot
of every run's p99 ratios, where the spread a single run has is plain to see.

Two sources:

    python3 bench/online_report.py --dir DIR [--md FILE] [--png FILE]
        DIR as ``bench/online_ab.sh`` leaves it ($OUT/ab): online-off.json and
        online-default-NAME-RUN.json for each server (NAME: new, old, new-ATTN_OTEL_X_V, ...)
    python3 bench/online_report.py --collection docs/benchmarks/online-ab-2026-11-26.json --key 26b
        one call kept in the A/B collection (its servers in the order they ran)

A server's configuration is its name less a trailing "-N" (the order's number); configurations are pooled by
that name.  Nothing here is timed: it reads what the servers measured.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

KEYS = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "goodput_req_s", "output_tokens_per_s")
RATIO_KEYS = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "goodput_req_s")


class ReportError(ValueError):
    """The files do not make a report (no capture-off server, no runs, runs of different lengths...)."""


def _runs(server: dict, where: str) -> list[dict]:
    runs = server.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ReportError(f"{where}: no runs")
    for k in KEYS:
        if any(not isinstance(r.get(k), (int, float)) for r in runs):
            raise ReportError(f"{where}: a run lacks {k}")
    return runs


def from_dir(d: Path) -> tuple[dict, list[tuple[str, dict]]]:
    """(off, [(server name, server)...]) from bench/online_ab.sh's $OUT/ab, ordered by run then file name."""
    off_f = d / "online-off.json"
    if not off_f.is_file():
        raise ReportError(f"{d}: no online-off.json (the capture-off reference; bench/online_ab.sh off)")
    servers = []
    for f in d.glob("online-default-*.json"):
        m = re.fullmatch(r"online-default-(.+)-(\d+)\.json", f.name)
        if not m:
            raise ReportError(f"{f.name}: not online-default-NAME-RUN.json")
        servers.append((int(m.group(2)), m.group(1), f))
    if not servers:
        raise ReportError(f"{d}: no online-default-NAME-RUN.json")
    servers.sort(key=lambda s: (s[0], s[1]))
    return (json.loads(off_f.read_text()),
            [(f"{name}-{run}", json.loads(f.read_text())) for run, name, f in servers])


def from_collection(path: Path, key: str) -> tuple[dict, list[tuple[str, dict]]]:
    doc = json.loads(path.read_text())
    if key not in doc:
        raise ReportError(f"{path.name}: no call {key!r} (it has {', '.join(sorted(doc))})")
    call = doc[key]
    phases, order = call.get("phases", {}), call.get("order") or list(call.get("phases", {}))
    if "off" not in phases:
        raise ReportError(f"{path.name} {key}: no capture-off server")
    return phases["off"], [(n, phases[n]) for n in order if n != "off"]


def config_of(name: str) -> str:
    """A server's configuration: its name less the trailing order number ("before-2" -> "before")."""
    return re.sub(r"-\d+$", "", name)


def analyse(off: dict, servers: list[tuple[str, dict]]) -> dict:
    off_runs = _runs(off, "off")
    med = {k: statistics.median(r[k] for r in off_runs) for k in KEYS}
    rows, by_config = [], {}
    for name, s in servers:
        runs = _runs(s, name)
        m = {k: statistics.median(r[k] for r in runs) for k in KEYS}
        cap = s.get("capture") or {}
        host = cap.get("step_host_s") or {}
        rows.append({
            "server": name, "config": config_of(name), "runs": len(runs), "env": s.get("env") or {},
            "median": m, "ratio": {k: m[k] / med[k] for k in RATIO_KEYS},
            "step_ms": {q: 1e3 * (cap.get("step_times") or {}).get(q, float("nan")) for q in ("p50", "p90", "p99")},
            "host_before_s": sum(v for k, v in host.items() if k != "after_launch"),
            "host_after_s": host.get("after_launch", 0.0),
            "finish_batches": (cap.get("finish_batch_sizes") or {}).get("n"),
            "side_stream_waits": cap.get("side_stream_waits"),
            "captured": cap.get("captured"), "dropped": sum((cap.get("dropped") or {}).values()),
            "slo_met": min(r.get("slo_met", 0.0) for r in runs),
        })
        by_config.setdefault(config_of(name), []).append(runs)
    pooled = {}
    for cfg, groups in by_config.items():
        runs = [r for g in groups for r in g]
        if any(len(g) > len(off_runs) for g in groups):
            raise ReportError(f"{cfg}: more runs than off's {len(off_runs)}: they cannot be paired by seed")
        paired = {k: statistics.median(r[k] / o[k] for g in groups for r, o in zip(g, off_runs)) for k in RATIO_KEYS}
        pooled[cfg] = {"servers": len(groups), "runs": len(runs),
                       "ratio": {k: statistics.median(r[k] for r in runs) / med[k] for k in RATIO_KEYS},
                       "paired_ratio": paired,
                       "per_run": {k: [[r[k] / o[k] for r, o in zip(g, off_runs)] for g in groups]
                                   for k in ("itl_p99_s", "ttft_p99_s")}}
    return {"off": {"runs": len(off_runs), "median": med, "device": off.get("device")}, "servers": rows,
            "configs": pooled}


def markdown(a: dict) -> str:
    o = a["off"]["median"]
    out = [f"capture off: {a['off']['runs']} runs on {a['off']['device'] or 'an unnamed device'}", "",
           "| server | runs | ITL p50 / p99 ms | TTFT p50 / p99 ms | goodput req/s | attn-otel step p50 / p90 / p99 ms "
           "| host s before + after the launch | finish batches | side-stream waits | captured, dropped |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
           f"| off | {a['off']['runs']} | {o['itl_p50_s'] * 1e3:.1f} / {o['itl_p99_s'] * 1e3:.1f} | "
           f"{o['ttft_p50_s'] * 1e3:.0f} / {o['ttft_p99_s'] * 1e3:.0f} | {o['goodput_req_s']:.1f} | | | | | |"]
    for r in a["servers"]:
        m, x, st = r["median"], r["ratio"], r["step_ms"]
        out.append(
            f"| {r['server']} | {r['runs']} | {m['itl_p50_s'] * 1e3:.1f} / {m['itl_p99_s'] * 1e3:.1f} "
            f"(x{x['itl_p50_s']:.2f} / x{x['itl_p99_s']:.2f}) | {m['ttft_p50_s'] * 1e3:.0f} / "
            f"{m['ttft_p99_s'] * 1e3:.0f} (x{x['ttft_p50_s']:.2f} / x{x['ttft_p99_s']:.2f}) | "
            f"{m['goodput_req_s']:.1f} | {st['p50']:.2f} / {st['p90']:.1f} / {st['p99']:.1f} | "
            f"{r['host_before_s']:.2f} + {r['host_after_s']:.2f} | {r['finish_batches']} | "
            f"{r['side_stream_waits']} | {r['captured']}, {r['dropped']} |")
    out += ["", "| configuration | servers, runs | ITL p50 / p99 | TTFT p50 / p99 | goodput | paired by seed: "
            "ITL p99 / TTFT p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for cfg, c in a["configs"].items():
        x, p = c["ratio"], c["paired_ratio"]
        out.append(f"| {cfg} | {c['servers']}, {c['runs']} | x{x['itl_p50_s']:.3f} / x{x['itl_p99_s']:.3f} | "
                   f"x{x['ttft_p50_s']:.3f} / x{x['ttft_p99_s']:.3f} | x{x['goodput_req_s']:.3f} | "
                   f"x{p['itl_p99_s']:.3f} / x{p['ttft_p99_s']:.3f} |")
    return "\n".join(out) + "\n"


def plot(a: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = list(a["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, label in zip(axes, ("itl_p99_s", "ttft_p99_s"), ("ITL p99", "TTFT p99")):
        for i, cfg in enumerate(cfgs):
            groups = a["configs"][cfg]["per_run"][key]
            for j, g in enumerate(groups):  # each server's runs, side by side
                xs = [i + (j - (len(groups) - 1) / 2) * 0.18] * len(g)
                ax.scatter(xs, g, s=18, alpha=0.75, label=None)
            ax.hlines(a["configs"][cfg]["ratio"][key], i - 0.35, i + 0.35, color="k", lw=2)
        ax.axhspan(0.97, 1.03, color="#55a868", alpha=0.15, lw=0, label="within 3% (issue 22's p99 target)")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(range(len(cfgs)), cfgs)
        ax.set_title(label, fontsize=9)
    axes[0].set_ylabel("ratio to capture off")
    axes[0].legend(loc="upper right", fontsize=7)
    fig.suptitle(f"{title}\ndots: each run against capture off's run of the same seed (a colour a server); "
                 "bar: the configuration's pooled median against off's", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dir", type=Path, help="bench/online_ab.sh's $OUT/ab")
    src.add_argument("--collection", type=Path, help="an A/B collection (docs/benchmarks/online-ab-*.json)")
    ap.add_argument("--key", help="with --collection: the call (26b, ...)")
    ap.add_argument("--md", type=Path, help="write the tables here (else stdout)")
    ap.add_argument("--png", type=Path, help="write the per-run plot here")
    ap.add_argument("--json", type=Path, help="write the analysis here")
    args = ap.parse_args(argv)
    try:
        if args.collection:
            if not args.key:
                ap.error("--collection needs --key")
            off, servers = from_collection(args.collection, args.key)
            title = f"{args.collection.name} {args.key}"
        else:
            off, servers = from_dir(args.dir)
            title = str(args.dir)
        a = analyse(off, servers)
    except (ReportError, OSError, json.JSONDecodeError) as e:
        print(f"online_report: {e}", file=sys.stderr)
        return 2
    text = markdown(a)
    if args.md:
        args.md.write_text(text)
    else:
        print(text, end="")
    if args.png:
        plot(a, args.png, f"online A/B, {title}: {a['off']['device'] or ''}")
    if args.json:
        args.json.write_text(json.dumps(a, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
