"""The online A/B's figures, from its raw files: one row a server (medians of its runs, ratios to capture off
in the same call), each configuration's runs pooled, the ratios paired by seed (every server of a call runs
the same arrival sequences, seeds 0..R-1, so run k of a server and run k of off met the same load), and a plot
of every run's p99 ratios, where the spread a single run has is plain to see.

Two sources:

    python3 bench/online_report.py --dir DIR [--md FILE] [--png FILE]
        DIR as ``bench/online_ab.sh`` leaves it ($OUT/ab): online-off.json and
        online-default-NAME-RUN.json for each server (NAME: new, old, new-ATTN_OTEL_X_V, ...)
    python3 bench/online_report.py --collection tests/data/bench/online-ab-2026-11-26.json --key 26b
        one call kept in the A/B collection (its servers in the order they ran)
    python3 bench/online_report.py --collection tests/data/bench/online-ab-2026-11-28.json --key 37b --reference old
        every ratio against the servers of one configuration instead of capture off (a call with no capture-off
        server, or one that A/Bs two capturing configurations: pooled and paired by seed the same way)

A server's configuration is its name less a trailing "-N" (the order's number); configurations are pooled by
that name.  A call may have several capture-off servers (``online-off.json`` from ``setup``, ``online-off-N.json``
from ``ab N off``): the reference is then all of their runs pooled (paired by seed: the median of the off
servers' runs of that seed), and each off server is also a row of its own, against the *other* off servers
(configuration ``off vs off``, whose pooled row gives the ratio farthest from 1 of them): how far two servers of
the same configuration drift apart on this machine, the noise any ratio of the call sits in.  Nothing here is timed: it reads what the servers measured.
"""

from __future__ import annotations

import argparse
import json
import math
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


def from_dir(d: Path, reference: str | None = None) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """([(reference server name, server)...], [(server name, server)...]) from bench/online_ab.sh's $OUT/ab, each
    ordered by run then file name; the reference is capture off, or with ``reference`` the servers of that
    configuration (the others, capture off's included, are compared with them)."""
    offs = []
    for f in d.glob("online-off*.json"):
        m = re.fullmatch(r"online-off(?:-(\d+))?\.json", f.name)
        if not m:
            raise ReportError(f"{f.name}: not online-off.json or online-off-RUN.json")
        offs.append((int(m.group(1) or 0), f))
    if reference is None and not any(run == 0 for run, _ in offs):
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
    named = [("off" if run == 0 else f"off-{run}", json.loads(f.read_text())) for run, f in sorted(offs)]
    return _split(named + [(f"{name}-{run}", json.loads(f.read_text())) for run, name, f in servers], reference,
                  str(d))


def from_collection(path: Path, key: str,
                    reference: str | None = None) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    doc = json.loads(path.read_text())
    if key not in doc:
        raise ReportError(f"{path.name}: no call {key!r} (it has {', '.join(sorted(doc))})")
    call = doc[key]
    phases, order = call.get("phases", {}), call.get("order") or list(call.get("phases", {}))
    return _split([(n, phases[n]) for n in order], reference, f"{path.name} {key}")


def _split(servers: list[tuple[str, dict]], reference: str | None, where: str):
    """(the reference servers, the others), each in the given order: capture off's, or ``reference``'s."""
    if reference is None:
        refs = [s for s in servers if _is_off(s[0])]
        if not refs:
            raise ReportError(f"{where}: no capture-off server")
    else:
        refs = [s for s in servers if config_of(s[0]) == reference]
        if not refs:
            have = ", ".join(dict.fromkeys(config_of(n) for n, _ in servers))
            raise ReportError(f"{where}: no server of configuration {reference!r} (it has {have})")
    return refs, [s for s in servers if not any(s is r for r in refs)]


def _is_off(name: str) -> bool:
    return re.fullmatch(r"off(-\d+)?", name) is not None


def config_of(name: str) -> str:
    """A server's configuration: its name less the trailing order number ("before-2" -> "before")."""
    return re.sub(r"-\d+$", "", name)


OFF_VS_OFF = "off vs off"  # each capture-off server against the others of its call: the call's noise


def _reference(offs: list[tuple[str, list[dict]]]) -> tuple[dict, list[dict]]:
    """The capture-off reference of several off servers' runs: (the median of every run, per key; per seed k,
    the median of the servers' runs k, per key)."""
    runs = [r for _, g in offs for r in g]
    med = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    seeds = max(len(g) for _, g in offs)
    by_seed = [{k: statistics.median(g[i][k] for _, g in offs if i < len(g)) for k in KEYS} for i in range(seeds)]
    return med, by_seed


def analyse(offs, servers: list[tuple[str, dict]], reference: str | None = None) -> dict:
    """``offs``: the reference servers, [(name, server)...] (or one server alone): capture off's, or those of
    the configuration ``reference``."""
    if isinstance(offs, dict):
        offs = [("off", offs)]
    same = OFF_VS_OFF if reference is None else f"{reference} vs {reference}"
    off_groups = [(n, _runs(s, n)) for n, s in offs]
    med, by_seed = _reference(off_groups)
    rows, by_config = [], {}
    if len(off_groups) > 1:  # each off server against the others: what two servers of one configuration differ by
        for i, (name, s) in enumerate(offs):
            others = _reference([g for j, g in enumerate(off_groups) if j != i])
            rows.append(_row(name, same, s, off_groups[i][1], others[0]))
            by_config.setdefault(same, []).append((off_groups[i][1], others))
    for name, s in servers:
        runs = _runs(s, name)
        rows.append(_row(name, config_of(name), s, runs, med))
        by_config.setdefault(config_of(name), []).append((runs, (med, by_seed)))
    pooled = {}
    for cfg, groups in by_config.items():
        runs = [r for g, _ in groups for r in g]
        if any(len(g) > len(ref[1]) for g, ref in groups):
            raise ReportError(f"{cfg}: more runs than off's {max(len(ref[1]) for _, ref in groups)}: they cannot be "
                              "paired by seed")
        paired = {k: statistics.median(r[k] / o[k] for g, ref in groups for r, o in zip(g, ref[1]))
                  for k in RATIO_KEYS}
        if cfg == same:  # the off server farthest from the others (a median of r and 1/r would be 1)
            ratio = {k: _farthest(statistics.median(r[k] for r in g) / ref[0][k] for g, ref in groups)
                     for k in RATIO_KEYS}
            paired = {k: _farthest(statistics.median(r[k] / o[k] for r, o in zip(g, ref[1])) for g, ref in groups)
                      for k in RATIO_KEYS}
        else:
            ratio = {k: statistics.median(r[k] for r in runs) / med[k] for k in RATIO_KEYS}
        pooled[cfg] = {"servers": len(groups), "runs": len(runs), "ratio": ratio,
                       "paired_ratio": paired,
                       "per_run": {k: [[r[k] / o[k] for r, o in zip(g, ref[1])] for g, ref in groups]
                                   for k in ("itl_p99_s", "ttft_p99_s")}}
    return {"off": {"runs": sum(len(g) for _, g in off_groups), "servers": len(off_groups), "median": med,
                    "device": offs[0][1].get("device"), "name": reference or "off",
                    "label": "capture off" if reference is None else reference},
            "servers": rows, "configs": pooled}


def _farthest(ratios) -> float:
    return max(ratios, key=lambda x: abs(math.log(x)))


def _row(name: str, config: str, s: dict, runs: list[dict], ref: dict) -> dict:
    m = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    cap = s.get("capture") or {}
    host = cap.get("step_host_s") or {}
    return {
        "server": name, "config": config, "runs": len(runs), "env": s.get("env") or {},
        "median": m, "ratio": {k: m[k] / ref[k] for k in RATIO_KEYS},
        "step_ms": {q: 1e3 * (cap.get("step_times") or {}).get(q, float("nan")) for q in ("p50", "p90", "p99")},
        "host_before_s": sum(v for k, v in host.items() if k != "after_launch"),
        "host_after_s": host.get("after_launch", 0.0),
        "finish_batches": (cap.get("finish_batch_sizes") or {}).get("n"),
        "side_stream_waits": cap.get("side_stream_waits"),
        "captured": cap.get("captured"), "dropped": sum((cap.get("dropped") or {}).values()),
        "slo_met": min(r.get("slo_met", 0.0) for r in runs),
    }


def markdown(a: dict) -> str:
    o = a["off"]["median"]
    n_off = a["off"].get("servers", 1)
    name = a["off"].get("name", "off")
    label = name if n_off == 1 else f"{name}, {n_off} servers pooled"
    out = [f"{a['off'].get('label', 'capture off')}: {a['off']['runs']} runs ({n_off} server{'s' * (n_off > 1)}) on "
           f"{a['off']['device'] or 'an unnamed device'}", "",
           "| server | runs | ITL p50 / p99 ms | TTFT p50 / p99 ms | goodput req/s | attn-otel step p50 / p90 / p99 ms "
           "| host s before + after the launch | finish batches | side-stream waits | captured, dropped |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
           f"| {label} | {a['off']['runs']} | {o['itl_p50_s'] * 1e3:.1f} / {o['itl_p99_s'] * 1e3:.1f} | "
           f"{o['ttft_p50_s'] * 1e3:.0f} / {o['ttft_p99_s'] * 1e3:.0f} | {o['goodput_req_s']:.1f} | | | | | |"]
    for r in a["servers"]:
        m, x, st = r["median"], r["ratio"], r["step_ms"]
        capture = ("| | | | | |" if r["config"] == OFF_VS_OFF or r["captured"] is None else  # capture off: nothing
                   # of attn-otel's to show
                   f"| {st['p50']:.2f} / {st['p90']:.1f} / {st['p99']:.1f} | "
                   f"{r['host_before_s']:.2f} + {r['host_after_s']:.2f} | {r['finish_batches']} | "
                   f"{r['side_stream_waits']} | {r['captured']}, {r['dropped']} |")
        out.append(
            f"| {r['server']} | {r['runs']} | {m['itl_p50_s'] * 1e3:.1f} / {m['itl_p99_s'] * 1e3:.1f} "
            f"(x{x['itl_p50_s']:.2f} / x{x['itl_p99_s']:.2f}) | {m['ttft_p50_s'] * 1e3:.0f} / "
            f"{m['ttft_p99_s'] * 1e3:.0f} (x{x['ttft_p50_s']:.2f} / x{x['ttft_p99_s']:.2f}) | "
            f"{m['goodput_req_s']:.1f} {capture}")
    out += ["", "| configuration | servers, runs | ITL p50 / p99 | TTFT p50 / p99 | goodput | paired by seed: "
            "ITL p99 / TTFT p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for cfg, c in a["configs"].items():
        x, p = c["ratio"], c["paired_ratio"]
        out.append(f"| {cfg} | {c['servers']}, {c['runs']} | x{x['itl_p50_s']:.3f} / x{x['itl_p99_s']:.3f} | "
                   f"x{x['ttft_p50_s']:.3f} / x{x['ttft_p99_s']:.3f} | x{x['goodput_req_s']:.3f} | "
                   f"x{p['itl_p99_s']:.3f} / x{p['ttft_p99_s']:.3f} |")
    return "\n".join(out) + "\n"


def _draw(ax, a: dict, key: str, names: list[str], legend: bool = False) -> None:
    """One axis: every run's ``key`` ratio to capture off's run of its seed (a colour a server, side by side), each
    configuration's pooled median as a bar, and the 3% band; ``names`` label the configurations."""
    cfgs = list(a["configs"])
    for i, cfg in enumerate(cfgs):
        groups = a["configs"][cfg]["per_run"][key]
        for j, g in enumerate(groups):  # each server's runs, side by side
            xs = [i + (j - (len(groups) - 1) / 2) * 0.18] * len(g)
            ax.scatter(xs, g, s=18, alpha=0.75, label=None)
        ax.hlines(a["configs"][cfg]["ratio"][key], i - 0.35, i + 0.35, color="k", lw=2)
    ax.axhspan(0.97, 1.03, color="#55a868", alpha=0.15, lw=0,
               label="within 3% (issue 22's p99 target)" if legend else None)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(range(len(cfgs)), names, **({} if legend else {"fontsize": 7, "rotation": 15}))


def plot(a: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, label in zip(axes, ("itl_p99_s", "ttft_p99_s"), ("ITL p99", "TTFT p99")):
        _draw(ax, a, key, list(a["configs"]), legend=True)
        ax.set_title(label, fontsize=9)
    ref = a["off"].get("label", "capture off")
    axes[0].set_ylabel(f"ratio to {ref}")
    axes[0].legend(loc="upper right", fontsize=7)
    fig.suptitle(f"{title}\ndots: each run against {ref}'s run of the same seed (a colour a server); "
                 f"bar: the configuration's pooled median against {ref}'s", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_calls(calls: list[tuple[str, dict]], png: Path, title: str) -> None:
    """Several calls side by side (a column a call, machines apart): every run's ITL and TTFT p99 ratio to the
    capture-off run of its seed, and each configuration's pooled median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(calls), figsize=(4.7 * len(calls), 7), sharey=True, squeeze=False)
    for j, (key, a) in enumerate(calls):
        names = [c.replace("new-ATTN_OTEL_", "").replace("new", "default") for c in a["configs"]]
        device = (a["off"]["device"] or "").split(", ")[-1][:12]
        for i, (metric, label) in enumerate((("itl_p99_s", "ITL p99"), ("ttft_p99_s", "TTFT p99"))):
            _draw(axes[i][j], a, metric, names)
            axes[i][j].set_title(f"{key} ({device}): {label}", fontsize=9)
            if j == 0:
                axes[i][j].set_ylabel(f"{label}, ratio to capture off")
    fig.suptitle(f"{title}\ndots: each run's p99 against the capture-off run of the same seed (a colour a server); bar: "
                 "the configuration's pooled median; green: within 3%; 'off vs off': each capture-off server against "
                 "the others", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dir", type=Path, help="bench/online_ab.sh's $OUT/ab")
    src.add_argument("--collection", type=Path,
                     help="an A/B collection (online-ab-*.json; past ones in tests/data/bench)")
    ap.add_argument("--key", help="with --collection: the call (26b, ...); several (32a,32b,32c): their tables one "
                                  "after the other and, with --png, one plot of a column a call")
    ap.add_argument("--md", type=Path, help="write the tables here (else stdout)")
    ap.add_argument("--png", type=Path, help="write the per-run plot here")
    ap.add_argument("--json", type=Path, help="write the analysis here")
    ap.add_argument("--reference", help="a configuration (old, new, ...) whose servers every ratio is to, instead of "
                                        "capture off")
    args = ap.parse_args(argv)
    try:
        if args.collection:
            if not args.key:
                ap.error("--collection needs --key")
            calls = [(k, analyse(*from_collection(args.collection, k, args.reference), args.reference))
                     for k in args.key.split(",")]
            title = f"{args.collection.name} {args.key}"
        else:
            calls = [(str(args.dir), analyse(*from_dir(args.dir, args.reference), args.reference))]
            title = str(args.dir)
    except (ReportError, OSError, json.JSONDecodeError) as e:
        print(f"online_report: {e}", file=sys.stderr)
        return 2
    one = calls[0][1] if len(calls) == 1 else None  # one call: its tables and plot; several: a section and a column each
    text = markdown(one) if one else "".join(f"## {k}\n\n{markdown(a)}\n" for k, a in calls)
    if args.md:
        args.md.write_text(text)
    else:
        print(text, end="")
    if args.png:
        if one:
            plot(one, args.png, f"online A/B, {title}: {one['off']['device'] or ''}")
        else:
            plot_calls(calls, args.png, f"online A/B, {title}")
    if args.json:
        args.json.write_text(json.dumps(one if one else dict(calls), indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
