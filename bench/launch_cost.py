"""Host time of one tap write (``attn_otel.triton_metrics.scatter_rows``, the call each streamed layer makes in
every eager forward: run 33's py-spy put the taps at 2.5% of the engine loop's main thread), split into what
the next design could save: the wrapper's checks and argument building, Triton's per-call binding
(``JITFunction.run``: specialisation, cache key), and the launch itself.

One process, one GPU (no vLLM needed), the stream tap's call as the streamed layers make it (Llama-3-8B shape:
32 query heads x 128 of bf16 queries into the ring through ``base``, the ring's slot table, 64 tokens).  Each
way is timed over ``--calls`` calls after a warm-up, with the device synchronised only at the end (the host's
time is what is measured; the launches queue):

* ``wrapper``: ``scatter_rows(...)`` as the stream calls it;
* ``jit``: the Triton kernel called directly with the arguments built once (``_scatter_rows[grid](...)``):
  what is left without the wrapper's checks;
* ``bound``: the compiled kernel's own launcher with the arguments bound once (``CompiledKernel[grid](...)``),
  where this Triton has it: what is left without Triton's binding too.

Each way's rows are checked against the wrapper's.  Reported: microseconds a call (median of ``--repeats``
timings) and each as a ratio to the wrapper's, in one call:

    python3 bench/launch_cost.py [--calls 2000] [--repeats 7] [--out docs/benchmarks/launch-cost-h100.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    import triton

    from attn_otel import triton_metrics as tm

    if not torch.cuda.is_available() or not tm.available(torch.device("cuda")):
        sys.exit("launch_cost: needs a CUDA device and Triton")
    dev = torch.device("cuda")
    n, rows, slots, hq, d = args.tokens, 4097, 1 << 16, 32, 128
    ring = torch.zeros(rows + 1, hq * d, dtype=torch.bfloat16, device=dev)
    query = torch.randn(n, hq * d, dtype=torch.bfloat16, device=dev)
    slot_mapping = torch.randperm(slots, device=dev)[:n].to(torch.int64)
    table = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)
    base = torch.zeros(1, dtype=torch.int64, device=dev)

    def wrapper():
        tm.scatter_rows(ring, query, slot_mapping, rows, table=table, base=base)

    C = ring[0].numel()
    jit_args = (query, ring, slot_mapping, table, query, ring, query.stride(0), ring.stride(0), query.stride(0),
                ring.stride(0), rows, query, query, query, query, *(0,) * 9, base, rows)
    jit_kw = dict(C=C, C2=C, HAS_TABLE=True, PAIRS=1, BLOCK=triton.next_power_of_2(C),
                  BLOCK2=triton.next_power_of_2(C), KV=False, HKV=1, D=1, BH=1, BD=1, RING=True, num_warps=4)

    def jit():
        tm._scatter_rows[(n,)](*jit_args, **jit_kw)

    ways = {"wrapper": wrapper, "jit": jit}
    notes = {}
    try:  # the compiled kernel and its launcher, where this Triton gives them
        compiled = tm._scatter_rows.warmup(*jit_args, grid=(n,), **jit_kw)
        runner = compiled[(n, 1, 1)]  # this launcher reads all three grid sizes
        # the launcher takes the kernel's arguments as the JIT function lists them, constexprs included
        params = list(tm._scatter_rows.params)
        values = dict(zip((p.name for p in params), jit_args)) | jit_kw
        # Triton versions differ on whether the launcher takes the constexprs too: try with, then without
        tries = {"all": [values[p.name] for p in params],
                 "no constexprs": [values[p.name] for p in params if not p.is_constexpr]}
        errors = []
        for label, bound_args in tries.items():
            try:
                runner(*bound_args)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{label}: {type(e).__name__}: {e}"[:200])
                continue

            def bound(bound_args=bound_args):
                runner(*bound_args)

            ways["bound"] = bound
            notes["bound_args"] = label
            break
        else:
            notes["bound"] = "; ".join(errors)
    except Exception as e:  # noqa: BLE001 - reported, the other ways still measured
        import traceback

        notes["bound"] = f"{type(e).__name__}: {e} at {traceback.extract_tb(e.__traceback__)[-1]}"[:400]

    check = {}
    for name, fn in ways.items():  # each way writes the rows the wrapper writes
        ring.zero_()
        table.fill_(-1)
        base.zero_()
        fn()
        torch.cuda.synchronize()
        check[name] = (ring.clone(), table.clone())
    ref = check["wrapper"]
    same = {name: bool(torch.equal(r, ref[0]) and torch.equal(t, ref[1])) for name, (r, t) in check.items()}

    us: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():  # alternated, so a drift of the machine reaches every way alike
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            us[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
    med = {name: statistics.median(v) for name, v in us.items()}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tokens": n, "calls": args.calls, "repeats": args.repeats, "us_per_call": med,
           "us_per_call_runs": us, "ratio_to_wrapper": {k: v / med["wrapper"] for k, v in med.items()},
           "rows_equal_to_wrapper": same, "notes": notes}
    for name in ways:
        print(f"{name:>8}: {med[name]:6.1f} us a call (x{med[name] / med['wrapper']:.2f} of the wrapper's), "
              f"rows {'equal' if same[name] else 'DIFFER'}")
    if "bound" in notes:
        print(f"   bound: not measured ({notes['bound']})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
