"""Where the engine-core process's threads spend their time: a summary of py-spy's collapsed stacks.

``bench/overhead.py --online PHASE`` with ``BENCH_PYSPY=/path/to/py-spy`` samples the server's engine-core
process (every thread, idle included) during the measured runs into ``DIR/pyspy-online-PHASE.txt``.  This
prints, per thread, its samples, and the frames (function, file) with the largest inclusive and self shares;
``--match attn_otel`` adds the inclusive share of every frame from that package:

    python3 bench/host_profile.py DIR/pyspy-online-default.txt [--match attn_otel] [--top 25]
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
    for line in path.read_text().splitlines():
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--match", help="also list the inclusive share of frames containing this text")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not args.path.exists():
        print(f"no such file: {args.path}", file=sys.stderr)
        return 2
    threads = parse(args.path)
    if not threads:
        print(f"no stacks in {args.path}", file=sys.stderr)
        return 1
    print(summarise(threads, args.match, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
