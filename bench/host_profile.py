"""Where the engine-core process's threads spend their time: a summary of py-spy's collapsed stacks.

``bench/overhead.py --online PHASE`` with ``BENCH_PYSPY=/path/to/py-spy`` samples the server's engine-core
process (every thread, idle included) during the measured runs into ``DIR/pyspy-online-PHASE.txt``.  This
prints, per thread, its samples, and the frames (function, file) with the largest inclusive and self shares;
``--match attn_otel`` adds the inclusive share of every frame from that package:

    python3 bench/host_profile.py DIR/pyspy-online-default.txt [--match attn_otel] [--top 25]
    python3 bench/host_profile.py DIR/pyspy-online-default.txt --own

``--own`` prints only the engine loop's main thread: attn-otel's own share of it by part (as runs 33-35 of
docs/benchmarks/history.md tabled it) and the share it waits for the GPU; ``--against OFF.txt`` (a capture-off server's
stacks, sampled the same way) puts the main thread's split beside capture off's: waiting for the GPU (in a
synchronize, and apart the sampler's lm_head GEMM launch, which blocks in some engines), waiting for requests,
attn-otel's own code, vLLM's own code (run 33: where the time attn-otel adds comes from).  A
sample is attn-otel's own where its deepest attn-otel frame runs attn-otel's code, not vLLM's call inside one
of attn-otel's wrappers (the patched methods, the tapped forward, the step hook's call of vLLM's scheduler):

    python3 bench/host_profile.py DIR/pyspy-online-default.txt --against DIR/pyspy-online-off.txt
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def _frame(raw: str) -> str:
    """``func (path/file.py:LINE)`` without the line: one entry per function."""
    m = _FRAME.match(raw.strip())
    return f"{m['func']} ({m['file']})" if m else raw.strip()


def parse(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """Per thread name: (frames root first, samples) for each collapsed stack."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    names: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():  # py-spy may write a stray byte in a name
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        while parts and parts[0].startswith("process "):
            parts.pop(0)
        if not parts:
            continue
        head = parts[0] if parts[0].startswith("thread ") else "thread ?"
        tid, _, name = head.partition(": ")  # py-spy names a thread on some samples only
        if name:
            names[tid] = name
        frames = [_frame(p) for p in (parts[1:] if parts[0].startswith("thread ") else parts)]
        threads[tid].append((frames, int(count)))
    return {f"{tid}: {names[tid]}" if tid in names else tid: v for tid, v in threads.items()}


def summarise(threads: dict, match: str | None, top: int) -> str:
    out = []
    total = sum(n for stacks in threads.values() for _, n in stacks)
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        n_thread = sum(n for _, n in stacks)
        if n_thread < 0.01 * total:
            continue
        incl: collections.Counter[str] = collections.Counter()
        self_: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            for f in set(frames):
                incl[f] += n
            if frames:
                self_[frames[-1]] += n
        out.append(f"## {thread}: {n_thread} samples\n")
        out.append("inclusive:")
        out += [f"  {100 * v / n_thread:5.1f}%  {k}" for k, v in incl.most_common(top)]
        out.append("self:")
        out += [f"  {100 * v / n_thread:5.1f}%  {k}" for k, v in self_.most_common(top)]
        if match:
            hits = [(k, v) for k, v in incl.items() if match in k]
            out.append(f"frames matching {match!r} (inclusive):")
            out += [f"  {100 * v / n_thread:5.1f}%  {k}" for k, v in sorted(hits, key=lambda kv: -kv[1])[:top]]
        out.append("")
    return "\n".join(out)


# attn-otel's parts on the engine loop, by the first of these (function, file) a sample holds (else "rest"); a
# function matches by its name or its last dotted part (py-spy 0.4 names "schedule", older ones
# "MetricsStream.schedule")
OWN_PARTS = (("schedule", "schedule", "attn_otel/stream.py"), ("taps", "forward", "attn_otel/vllm_adapter.py"),
             ("captures", "on_finished_many", "attn_otel/capture.py"), ("finish rows", "finish", "attn_otel/stream.py"),
             ("step bookkeeping", "_track", "attn_otel/vllm_adapter.py"),
             ("after the launch", "_run_after_launch", "attn_otel/vllm_adapter.py"))


def _is(frame: str, func: str, file: str) -> bool:
    name, _, where = frame.partition(" (")
    return (name == func or name.endswith("." + func)) and where.startswith(file)


def own_shares(threads: dict, package: str = "attn_otel/") -> dict:
    """The main thread's samples (the thread named MainThread, else the largest): ``{"samples", "parts":
    {part: share}, "total", "gpu_wait"}`` (shares of its samples; gpu_wait: a CUDA ``synchronize`` outside
    attn-otel's frames).  A sample is attn-otel's own where no vLLM frame lies below its deepest attn-otel
    frame: vLLM's scheduler called from the step hook, the forward called through a patched method (with
    torch's decorators between) and the attention inside a tapped forward are vLLM's time."""
    named = [t for t in threads if t.endswith("MainThread")]
    main_t = named[0] if named else max(threads, key=lambda t: sum(n for _, n in threads[t]))
    stacks = threads[main_t]
    total = sum(n for _, n in stacks)
    parts: collections.Counter[str] = collections.Counter()
    wait = 0
    for frames, n in stacks:
        ours = [i for i, f in enumerate(frames) if package in f]
        if not ours:
            if frames and frames[-1].split(" (")[0].endswith("synchronize") and "torch/cuda" in frames[-1]:
                wait += n
            continue
        if any("vllm/" in f for f in frames[ours[-1] + 1:]):
            continue  # vLLM's own work inside attn-otel's wrapper
        held = [frames[i] for i in ours]
        parts[next((p for p, func, file in OWN_PARTS if any(_is(f, func, file) for f in held)), "rest")] += n
    shares = {p: parts[p] / total for p in [*(p for p, *_ in OWN_PARTS), "rest"]} if total else {}
    return {"thread": main_t, "samples": total, "parts": shares, "total": sum(shares.values()),
            "gpu_wait": wait / total if total else 0.0}


def main_split(threads: dict) -> dict:
    """The main thread's samples split five ways (shares): ``gpu_wait`` (a CUDA ``synchronize`` outside
    attn-otel's frames), ``launch_wait`` (the sampler's blocked lm_head GEMM launch: :func:`_blocked_launch`),
    ``request_wait`` (vLLM's loop waiting for requests: ``_process_input_queue``),
    ``attn_otel`` (its own code, as :func:`own_shares` counts it) and ``vllm`` (the rest: vLLM's, torch's and
    Triton's host code)."""
    own = own_shares(threads)
    total = own["samples"]
    stacks = threads[own["thread"]]
    idle = sum(n for frames, n in stacks
               if any(_is(f, "_process_input_queue", "vllm/") for f in frames)) / total if total else 0.0
    launch = sum(n for frames, n in stacks if _blocked_launch(frames)) / total if total else 0.0
    rest = 1.0 - own["gpu_wait"] - idle - own["total"] - launch
    return {"samples": total, "gpu_wait": own["gpu_wait"], "launch_wait": launch, "request_wait": idle,
            "attn_otel": own["total"], "vllm": rest}


def _blocked_launch(frames: list[str]) -> bool:
    """The sampler's first launch after the forward, the lm_head GEMM (``compute_logits``), as the sample's
    own frame: a launch that holds the host until the GPU has run ahead, not vLLM's Python.  Run 49 on one H200
    found it at 0.5% of the loop in one capture-off engine and 10.4% in the next, with the step's synchronize
    shorter by about as much: it moves where the loop waits for the GPU, capture on or off, not how long."""
    return bool(frames) and _is(frames[-1], "default_unquantized_gemm", "vllm/") and any(
        _is(f, "compute_logits", "vllm/") for f in frames)


def format_against(on: dict, off: dict) -> str:
    rows = (("waiting for the GPU", "gpu_wait"), ("  and in the lm_head GEMM's launch", "launch_wait"),
            ("waiting for requests", "request_wait"),
            ("attn-otel's own code", "attn_otel"), ("vLLM's own code (and torch's, Triton's)", "vllm"))
    lines = [f"the engine loop's main thread: {on['samples']} samples, capture off {off['samples']}",
             f"{'':42s} {'capture on':>10s} {'off':>7s} {'on - off':>9s}"]
    lines += [f"{name:42s} {100 * on[k]:9.1f}% {100 * off[k]:6.1f}% {100 * (on[k] - off[k]):+8.1f}"
              for name, k in rows]
    return "\n".join(lines)


def format_own(own: dict) -> str:
    lines = [f"## {own['thread']}: {own['samples']} samples", "attn-otel's own time, by part:"]
    lines += [f"  {100 * v:5.1f}%  {p}" for p, v in own["parts"].items()]
    lines += [f"  {100 * own['total']:5.1f}%  total", f"waiting for the GPU (synchronize): "
              f"{100 * own['gpu_wait']:.1f}%"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--match", help="also list the inclusive share of frames containing this text")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--own", action="store_true", help="the main thread only: attn-otel's own share by part")
    ap.add_argument("--against", type=Path, help="a capture-off server's stacks: the main thread's split beside it")
    args = ap.parse_args(argv)
    parsed = []
    for path in [args.path] + ([args.against] if args.against else []):
        if not path.exists():
            print(f"no such file: {path}", file=sys.stderr)
            return 2
        parsed.append(parse(path))
        if not parsed[-1]:
            print(f"no stacks in {path}", file=sys.stderr)
            return 1
    threads = parsed[0]
    if args.against:
        print(format_against(main_split(threads), main_split(parsed[1])))
        return 0
    print(format_own(own_shares(threads)) if args.own else summarise(threads, args.match, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
