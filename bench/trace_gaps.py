"""Where a GPU waits, from a torch.profiler chrome trace (vLLM's ``--profiler-config`` writes one per
engine core): the GPU's busy time (the union of kernels, copies and sets), its idle gaps, and, for the idle
time, the innermost Python function each host thread was in (with_stack traces).

    python3 bench/trace_gaps.py TRACE.json[.gz] [--top 25] [--summary OUT.json]
    python3 bench/trace_gaps.py --compare OFF.json ON.json

``--summary`` keeps, beside the text, a small JSON of the trace by engine step (:func:`summary`): vLLM's
profiler names each step's range ``execute_context_A(B)_generation_C(D)``, and each kernel is put in the step
whose host range launched it (the runtime call with the kernel's correlation id, on the step's thread; a CUDA
graph's kernels share their launch's).  ``--compare`` sets two such summaries side by side, step kind by step kind: whether capture
makes the forwards' own kernels slower (contention, or work inside the graphs), adds its own kernels to the
steps, or leaves the GPU idle longer between them.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import itertools
import json
import re
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
            best = min(_holding(evs, starts[tid], mid), key=_dur, default=None)
            if best is not None:
                blame[(tid, best[2][:90])] += g
    launcher = _launchers(events, py, starts, {b for g, _, b, _, _ in gaps if g >= 5})
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
    if launcher:
        # the op the GPU waited for, by the host code that launched it: with stacks, the innermost attn-otel frame
        idle, count = collections.Counter(), collections.Counter()
        for g, _, b, _, _ in gaps:
            who = launcher.get(b)  # (gaps of 5 us or more only: the others' ops were not looked up)
            if who is not None:
                idle[who] += g
                count[who] += 1
        out.append("")
        out.append("idle time (gaps >= 5 us) by the host code that launched the op ending the gap:")
        out += [f"  {t / 1e3:9.1f} ms in {count[k]:6d} gaps  {k}" for k, t in idle.most_common(top)]
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


def _dur(ev: tuple) -> float:
    return ev[1] - ev[0]


def _holding(evs: list[tuple], starts: list[float], t: float) -> list[tuple]:
    """One thread's host events (``(start, end, name)`` sorted, ``starts`` their starts) that hold time ``t``:
    started at or before it and not ended, among the 400 that started last."""
    i = bisect.bisect_right(starts, t)
    return [ev for ev in evs[max(0, i - 400):i] if ev[1] >= t]


def _runtime_calls(events: list[dict]) -> dict:
    """Correlation id -> the CUDA runtime or driver call that has it (a kernel, copy or set shares its launch's)."""
    calls = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                calls[c] = e
    return calls


def _launchers(events: list[dict], host: dict, starts: dict, wanted: set) -> dict:
    """The start of each GPU op that starts at a time in ``wanted`` -> the host code that launched it: the runtime
    call with its correlation id, and on that call's thread (``host``: its events, ``starts``: their starts) the
    innermost enclosing ``attn_otel`` Python frame (traces with stacks), else the innermost enclosing CPU op or
    frame.  {} where the trace has no correlation ids."""
    calls = _runtime_calls(events)
    if not calls:
        return {}
    out = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        if e["ts"] not in wanted:
            continue
        call = calls.get((e.get("args") or {}).get("correlation"))
        if call is None:
            continue
        held = [ev for ev in _holding(host.get(call["tid"], []), starts.get(call["tid"], []), call["ts"])
                if ev[2] != call["name"]]
        pick = min([ev for ev in held if "attn_otel" in ev[2]] or held, key=_dur, default=None)
        out[e["ts"]] = pick[2][:90] if pick else call["name"]
    return out


OWN = ("_row_metrics", "_summaries", "_scatter_rows", "_ring_advance")  # attn-otel's Triton kernels
# vLLM's attention kernels by name (FlashAttention 2/3 and its split-KV combine, the Triton backend's, FlashInfer's),
# not its KV-cache write (reshape_and_cache_flash_kernel): what attn-otel's metric kernel is set against per step
ATTENTION = re.compile(r"flash::|flash_fwd|FlashAttn|unified_attention|BatchPrefill|BatchDecode|fmha", re.I)
_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
_DECODE_EDGES = (0, 8, 32, 64, 128, 192, 256, 384, 512, 1 << 30)


def step_kind(ctx_reqs: int, ctx_tokens: int, gen_reqs: int) -> str:
    """A step's bucket: any prefill tokens, else its decode batch by size."""
    if ctx_tokens:
        return "prefill"
    for lo, hi in zip(_DECODE_EDGES, _DECODE_EDGES[1:]):
        if lo < gen_reqs <= hi:
            return f"decode {lo + 1}-{hi}" if hi < 1 << 30 else f"decode > {lo}"
    return "empty"


def summary(events: list[dict]) -> dict:
    """The trace by engine step: per step kind, the steps, their kernels' device time (vLLM's own, of which its
    attention kernels by :data:`ATTENTION`, and attn-otel's, :data:`OWN`), the span from a step's first kernel
    to its last, and the GPU's idle time (no kernel, copy or set on any stream) in that span and before it, since
    the previous step's last kernel;
    kernels launched outside every step (attn-otel's threads; vLLM's sampler, launched after execute_model) by
    stream and by name; and the whole window's span, busy and idle time."""
    steps = sorted((e["ts"], e["ts"] + e.get("dur", 0), m.groups(), e.get("tid")) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and (m := _STEP.search(e.get("name", ""))))
    starts = [s[0] for s in steps]
    launch = {c: (e["ts"], e.get("tid")) for c, e in _runtime_calls(events).items()}  # correlation -> host time, thread
    kinds: dict = {}
    per_step = [{"own": 0.0, "vllm": 0.0, "attention": 0.0, "first": None, "last": None} for _ in steps]
    outside: collections.Counter = collections.Counter()
    outside_by_name: collections.Counter = collections.Counter()
    in_steps: collections.Counter = collections.Counter()  # every kernel launched in a step: time, launches
    in_steps_n: collections.Counter = collections.Counter()
    gpu = []
    for e in events:
        if not (e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
            continue
        a, d, args, name = e["ts"], e.get("dur", 0), e.get("args") or {}, e.get("name", "")[:60]
        gpu.append((a, a + d))
        own = e.get("cat") == "kernel" and name.startswith(OWN)
        t, tid = launch.get(args.get("correlation"), (None, None))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i < 0 or t > steps[i][1] or tid != steps[i][3]:
            outside[f"stream {args.get('stream')} {'attn-otel' if own else 'other'}"] += d
            outside_by_name[name] += d
            continue
        in_steps[name] += d
        in_steps_n[name] += 1
        p = per_step[i]
        p["own" if own else "vllm"] += d
        if not own and ATTENTION.search(name):
            p["attention"] += d
        p["first"] = a if p["first"] is None else min(p["first"], a)
        p["last"] = a + d if p["last"] is None else max(p["last"], a + d)
    gpu.sort()
    merged: list = []  # the GPU's busy time as disjoint intervals (any kernel, copy or set, any stream)
    for a, b in gpu:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts_m = [m[0] for m in merged]
    cum = list(itertools.accumulate((m[1] - m[0] for m in merged), initial=0.0))

    def idle_between(x: float, y: float) -> float:
        """The GPU's idle time in (x, y)."""
        if y <= x:
            return 0.0
        i, j = bisect.bisect_right(starts_m, x), bisect.bisect_left(starts_m, y)
        busy_xy = cum[j] - cum[i]  # intervals starting inside (x, y), clipped at y below
        if j > i and merged[j - 1][1] > y:
            busy_xy -= merged[j - 1][1] - y
        if i > 0 and merged[i - 1][1] > x:  # the interval running at x
            busy_xy += min(merged[i - 1][1], y) - x
        return (y - x) - busy_xy

    prev_end = None
    for (_, _, g, _), p in zip(steps, per_step):
        if p["first"] is None:
            continue
        k = kinds.setdefault(step_kind(int(g[0]), int(g[1]), int(g[2])),
                             {"steps": 0, "tokens": 0, "vllm_us": 0.0, "attention_us": 0.0, "own_us": 0.0,
                              "span_us": 0.0, "idle_before_us": 0.0, "idle_in_us": 0.0})
        k["steps"] += 1
        k["tokens"] += int(g[1]) + int(g[3])
        k["vllm_us"] += p["vllm"]
        k["attention_us"] += p["attention"]
        k["own_us"] += p["own"]
        k["span_us"] += p["last"] - p["first"]
        k["idle_in_us"] += idle_between(p["first"], p["last"])
        if prev_end is not None:  # the GPU idle (no kernel of any stream) since the previous step's last kernel
            k["idle_before_us"] += idle_between(prev_end, p["first"])
        prev_end = max(prev_end or p["last"], p["last"])
    busy = cum[-1]
    span = merged[-1][1] - merged[0][0] if merged else 0.0
    return {"steps": len(steps), "kinds": kinds, "outside_us": dict(outside), "span_us": span, "busy_us": busy,
            "idle_us": span - busy, "by_name_us": {"own in steps": dict([(n, t) for n, t in in_steps.most_common() if n.startswith(OWN)][:12]),
                           "outside steps": dict(outside_by_name.most_common(12))},
            "in_steps": {n: [round(t, 1), in_steps_n[n]] for n, t in in_steps.most_common(200)}}


def compare(off: dict, on: dict) -> str:
    """Two :func:`summary` dicts side by side (the second against the first), per step kind."""
    out = [f"steps {off['steps']} / {on['steps']}; GPU span {off['span_us'] / 1e6:.3f} / {on['span_us'] / 1e6:.3f} s "
           f"(x{on['span_us'] / max(off['span_us'], 1):.4f}); busy {off['busy_us'] / 1e6:.3f} / {on['busy_us'] / 1e6:.3f} s; "
           f"idle {off['idle_us'] / 1e6:.3f} / {on['idle_us'] / 1e6:.3f} s", "",
           "| step kind | steps | tokens a step | vLLM's kernels a step, us | x | attn-otel's kernels a step, us "
           "| span a step, us | x | GPU idle before a step, us | GPU idle in a step, us |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    att = []  # (summaries since run 52): per step, vLLM's attention kernels (every layer's) against attn-otel's
    for name in sorted(set(off["kinds"]) | set(on["kinds"]), key=lambda n: (n != "prefill", len(n), n)):
        a, b = off["kinds"].get(name), on["kinds"].get(name)
        if not a or not b:
            out.append(f"| {name} | {a and a['steps']} / {b and b['steps']} | | | | | | | | |")
            continue
        pa = {k: v / a["steps"] for k, v in a.items() if k != "steps"}
        pb = {k: v / b["steps"] for k, v in b.items() if k != "steps"}
        out.append(f"| {name} | {a['steps']} / {b['steps']} | {pa['tokens']:.0f} / {pb['tokens']:.0f} "
                   f"| {pa['vllm_us']:.0f} / {pb['vllm_us']:.0f} | x{pb['vllm_us'] / max(pa['vllm_us'], 1e-9):.3f} "
                   f"| {pb['own_us']:.0f} | {pa['span_us']:.0f} / {pb['span_us']:.0f} "
                   f"| x{pb['span_us'] / max(pa['span_us'], 1e-9):.3f} | {pa['idle_before_us']:.0f} / {pb['idle_before_us']:.0f} "
                   f"| {pa.get('idle_in_us', float('nan')):.0f} / {pb.get('idle_in_us', float('nan')):.0f} |")
        if "attention_us" in pa and "attention_us" in pb:
            att.append(f"| {name} | {pa['attention_us']:.0f} / {pb['attention_us']:.0f} | "
                       + (f"{b['own_us'] / b['attention_us']:.3f} |" if b["attention_us"] else "- |"))
    if att:
        out += ["", "| step kind | vLLM's attention kernels a step, us (off / on) | attn-otel's kernels / vLLM's attention |",
                "| --- | --- | --- |", *att]
    for part in ("own in steps", "outside steps"):
        names = {**off.get("by_name_us", {}).get(part, {}), **on.get("by_name_us", {}).get(part, {})}
        if names:
            out += ["", f"{part}, the longest by kernel, us (off / on):"]
            out += [f"  {off.get('by_name_us', {}).get(part, {}).get(n, 0):9.0f} / "
                    f"{on.get('by_name_us', {}).get(part, {}).get(n, 0):9.0f}  {n}"
                    for n in sorted(names, key=lambda n: -on.get("by_name_us", {}).get(part, {}).get(n, 0))]
    a_in, b_in = off.get("in_steps") or {}, on.get("in_steps") or {}
    if a_in and b_in:  # which kernels the steps gain or lose (time and launches), the largest changes first
        delta = {n: (b_in.get(n, [0, 0])[0] - a_in.get(n, [0, 0])[0], b_in.get(n, [0, 0])[1] - a_in.get(n, [0, 0])[1])
                 for n in set(a_in) | set(b_in)}
        out += ["", "kernels launched in the steps, the largest changes (time us, launches; on - off):"]
        out += [f"  {dt:+10.0f} us {dn:+7d}  {n}" for n, (dt, dn) in
                sorted(delta.items(), key=lambda kv: -abs(kv[1][0]))[:15] if dt or dn]
    out += ["", "kernels launched outside every step, us: "
            f"{json.dumps({k: round(v) for k, v in off['outside_us'].items()})} / "
            f"{json.dumps({k: round(v) for k, v in on['outside_us'].items()})}"]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--summary", help="also write the trace's summary by engine step (JSON) here")
    ap.add_argument("--compare", nargs=2, metavar=("OFF", "ON"), help="two --summary files side by side")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(*(json.loads(open(p).read()) for p in args.compare)))
        return 0
    if not args.trace:
        ap.error("give a trace, or --compare OFF ON")
    events = load(args.trace)
    print(analyse(events, args.top))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary(events), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
