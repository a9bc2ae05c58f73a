"""The stream's flush as the engine launches it, its keys given by slot (one entry a key position, as up to
2026-11-28) against by block (one entry a block: ``paged``, ATTN_OTEL_FLUSH_KEYS=blocks), on the device (no vLLM
needed): a Llama-3-8B-shaped stream (bench/flush_host.py's: 4 streamed layers in one launch, 32 query heads,
8 KV heads, head_dim 128, block size 16) with ``--live`` requests of lognormal lengths in flight, their rows
pending as at a half-ring flush (``--rows`` rows each) and at a finish (1 row).  Each figure is the median over
``--reps`` alternated launches of one layout: its device milliseconds (CUDA events around the upload and the
kernel, on one stream) and its host milliseconds (building the keys' array, the upload and the launch).

    python3 bench/flush_layout.py [--live 100] [--rows 40] [--reps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import flush_host  # noqa: E402

from attn_otel.slots import blocks_many, slots_many  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, default=100)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flush_layout: needs a CUDA device (the kernels are Triton's)")
    st, layers, reqs = flush_host.build(a.live, 8192, "cuda")
    st.warm_up()
    for r in reqs:
        flush_host.prefill(st, layers, r)
    torch.cuda.synchronize()
    lives = list(st._live.values())
    ends = np.asarray([lv.next for lv in lives], dtype=np.int64)
    lists = [lv.tracked.block_ids[st.group] for lv in lives]
    prompt = [len(lv.tracked.prompt_token_ids) for lv in lives]
    res: dict = {}
    for case, per in (("half_ring", a.rows), ("finish", 1)):
        counts = [int(min(per, e)) for e in ends]
        firsts = (ends - np.asarray(counts)).tolist()

        def launch(paged: bool) -> float:
            t0 = time.perf_counter()
            keys, cu = blocks_many(lists) if paged else slots_many(lists, st.block_size, ends)
            st.kernels.run_fused(firsts, counts, keys, cu, prompt, None, None, table=st.ring_of_slot,
                                 paged=st.block_size if paged else 0)
            return time.perf_counter() - t0

        for paged in (False, True):  # compile both
            launch(paged)
        torch.cuda.synchronize()
        got = {"slots": {"device_ms": [], "host_ms": []}, "blocks": {"device_ms": [], "host_ms": []}}
        for _ in range(a.reps):
            for paged, name in ((False, "slots"), (True, "blocks")):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                host = launch(paged)
                e.record()
                torch.cuda.synchronize()
                got[name]["device_ms"].append(s.elapsed_time(e))
                got[name]["host_ms"].append(host * 1e3)
        med = {n: {k: round(float(np.median(v)), 4) for k, v in d.items()} for n, d in got.items()}
        med["ratio_blocks_to_slots"] = {k: round(med["blocks"][k] / med["slots"][k], 3) for k in ("device_ms", "host_ms")}
        med["rows"], med["keys"] = int(sum(counts)), int(ends.sum())
        res[case] = med
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "live": a.live, "reps": a.reps,
           "cases": res}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
