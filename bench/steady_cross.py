"""attn-otel's host time in the offline 512+256 shape's decode-only steps (no arrival, no finish), where the step
counter's members cross their blocks together: ``vllm_adapter._track`` timed per step over ``bench/step_track.py``'s
loop with ``--fixed 512+256 --live 256``, for the checkout named (its package first on the path).

    python3 bench/steady_cross.py CHECKOUT      (one JSON line: the steps' mean, p50, the slowest 1/16's mean, max, us)

Run it for two checkouts in turn, a few rounds, on an otherwise idle machine (docs/benchmarks/steady-cross-cpu.json).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    root = sys.argv[1]
    sys.path[:0] = [root, root + "/bench"]
    import numpy as np

    import attn_otel
    import step_track
    from attn_otel import vllm_adapter

    times: list[float] = []
    track = vllm_adapter._track

    def timed(runner, engine, so, t0):
        a = time.perf_counter()
        out = track(runner, engine, so, t0)
        if not so.scheduled_new_reqs and not so.finished_req_ids:
            times.append(time.perf_counter() - a)
        return out

    vllm_adapter._track = timed
    step_track.measure(256, 700, "cpu", fixed=(512, 256))
    t = np.sort(np.asarray(times) * 1e6)
    print(json.dumps({"attn_otel": attn_otel.__file__, "steps": len(t), "mean_us": round(float(t.mean()), 1),
                      "p50_us": round(float(np.median(t)), 1),
                      "top_1_16_mean_us": round(float(t[-len(t) // 16:].mean()), 1),
                      "max_us": round(float(t.max()), 1)}))


if __name__ == "__main__":
    main()
