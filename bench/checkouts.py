"""This checkout against another attn-otel in one call on one machine, for the benches that compare two
(bench/flush_host.py, bench/stream_schedule.py, bench/step_track.py): each measurement runs a bench script in a
subprocess with one checkout's package first on PYTHONPATH, in rounds (a lent machine's host speed drifts by up to
2x between runs a minute apart, so only rounds taken in turn compare)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

HERE = str(Path(__file__).resolve().parent.parent)  # this checkout's root


def baseline(path: str, marker: str = "__init__.py", hint: str = "give a checkout of attn-otel") -> str:
    """``path`` resolved, or exit with a message naming it where it holds no ``attn_otel/{marker}``."""
    if not (Path(path) / "attn_otel" / marker).is_file():
        raise SystemExit(f"--baseline {path}: no attn_otel package there ({hint})")
    return str(Path(path).resolve())


def run(script: str, argv: Sequence[str], path: str) -> dict:
    """``script argv`` with the checkout at ``path`` first on PYTHONPATH: the JSON object it printed last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, script, *argv], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out[out.find("{"):out.rindex("}") + 1])


def rounds(script: str, argv: Sequence[str], checkouts: dict[str, str], n: int,
           swap: bool = False) -> dict[str, list[dict]]:
    """``n`` rounds of :func:`run`, each checkout once a round in the order given (``swap``: reversed every
    other round); per checkout its results in round order."""
    got: dict[str, list[dict]] = {name: [] for name in checkouts}
    for rnd in range(n):
        order = list(checkouts.items())
        for name, path in (order[::-1] if swap and rnd % 2 else order):
            print(f"round {rnd + 1}/{n}: {name} ...", file=sys.stderr, flush=True)
            got[name].append(run(script, argv, path))
    return got


def revisions(checkouts: dict[str, str]) -> dict[str, str]:
    """Each checkout's short commit (empty where it is no git checkout)."""
    return {name: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for name, path in checkouts.items()}
