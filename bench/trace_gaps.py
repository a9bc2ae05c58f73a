"""Where a GPU waits, from a torch.profiler chrome trace (vLLM's ``--profiler-config`` writes one per
engine core): the GPU's busy time (the union of kernels, copies and sets), its idle gaps, and, for the idle
time, the innermost Python function each host thread was in (with_stack traces).

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 25]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def analyse(events: list[dict], top: int = 25) -> str:
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not gpu:
        return "no GPU events\n"
    busy, gaps, end, prev = 0.0, [], gpu[0][0], gpu[0][2]
    for a, b, name in gpu:
        if a > end:
            gaps.append((a - end, end, a, prev, name))
        if b > end:
            busy += b - max(a, end)
            end, prev = b, name
    span = end - gpu[0][0]
    out = [f"GPU busy {busy / 1e6:.3f} s of {span / 1e6:.3f} s ({busy / span:.1%}); idle {sum(g[0] for g in gaps) / 1e6:.3f} s "
           f"in {len(gaps)} gaps, {sum(g[0] for g in gaps if g[0] >= 500) / 1e6:.3f} s in gaps >= 0.5 ms"]
    # innermost python function per thread at each gap's midpoint, weighted by the gap
    py = collections.defaultdict(list)
    rt = collections.defaultdict(lambda: [0, 0.0, 0.0])  # (tid, CUDA call) -> calls, total and longest time
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation",
                                                        "cuda_runtime", "cuda_driver"):
            py[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
            if e["cat"] in ("cuda_runtime", "cuda_driver"):
                r = rt[(e["tid"], e["name"])]
                r[0] += 1
                r[1] += e.get("dur", 0)
                r[2] = max(r[2], e.get("dur", 0))
    for tid in py:
        py[tid].sort()
    starts = {tid: [x[0] for x in v] for tid, v in py.items()}
    blame = collections.Counter()
    for g, a, b, _, _ in gaps:
        if g < 200:
            continue
        mid = (a + b) / 2
        for tid, evs in py.items():
            i = bisect.bisect_right(starts[tid], mid)
            best = None
            for j in range(max(0, i - 400), i):  # events that started before mid and end after it
                s, e, name = evs[j]
                if e >= mid and (best is None or e - s < best[1] - best[0]):
                    best = (s, e, name)
            if best is not None:
                blame[(tid, best[2][:90])] += g
    gaps.sort(reverse=True)
    out.append("")
    out.append("longest gaps:")
    out += [f"  {g / 1e3:8.2f} ms after {p[:50]!r} before {n[:50]!r}" for g, _, _, p, n in gaps[:top]]
    out.append("")
    out.append("idle time by gap size:")
    edges = [0, 5, 20, 50, 200, 500, float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        label = f">= {lo / 1e3:g} ms" if hi == float("inf") else f"{lo:g}-{hi:g} us"
        out.append(f"  {label:>12}: {len(sel):7d} gaps, {sum(sel) / 1e3:9.1f} ms")
    # gaps by the device op on either side: which op the GPU waits before (launched late), or after
    for side, word, pick in (("ends", "before", lambda p, n: n), ("starts", "after", lambda p, n: p)):
        idle, count = collections.Counter(), collections.Counter()
        for g, _, _, p, n in gaps:
            idle[pick(p, n)[:60]] += g
            count[pick(p, n)[:60]] += 1
        out.append("")
        out.append(f"idle time (all gaps) by the device op that {side} the gap:")
        out += [f"  {t / 1e3:9.1f} ms in {count[k]:6d} gaps {word} {k!r}" for k, t in idle.most_common(12)]
    out.append("")
    out.append("host time in CUDA runtime/driver calls, per thread (the longest):")
    out += [f"  {t / 1e3:9.1f} ms in {n:7d} calls (max {m / 1e3:7.2f} ms)  tid {tid}  {name}"
            for (tid, name), (n, t, m) in sorted(rt.items(), key=lambda kv: -kv[1][1])[:top]]
    out.append("")
    out.append("idle time (gaps >= 0.2 ms) by the innermost host function at the gap's middle, per thread:")
    out += [f"  {t / 1e3:9.1f} ms  tid {tid}  {name}" for (tid, name), t in blame.most_common(top)]
    by_kernel: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    for a, b, name in gpu:
        by_kernel[name[:90]] += b - a
        launches[name[:90]] += 1
    total = sum(by_kernel.values()) or 1.0
    out += ["", "GPU time by kernel (copies and sets included), the longest:"]
    out += [f"  {d / 1000:10.1f} ms {100 * d / total:5.1f}% {launches[n]:8d} launches  {n}" for n, d in by_kernel.most_common(top + 15)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(analyse(load(args.trace), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
