"""Host time of one tap write (``attn_otel.triton_metrics.scatter_rows``, the call each streamed layer makes in
every eager forward: run 33's py-spy put the taps at 2.5% of the engine loop's main thread), split into what
each design costs: the wrapper's checks and argument building, Triton's per-call binding (``JITFunction.run``:
specialisation, cache key), and the launch itself.

One process, one GPU (no vLLM needed), the stream tap's calls as the streamed layers make them (Llama-3-8B
shape: 32 query heads x 128 of bf16 queries into the ring through ``base``, the ring's slot table, 64 tokens),
in two cases: ``ring`` (the query alone) and ``ring+kv`` (with vLLM's KV-cache write fused into the launch, as
on FLASH_ATTN with ``ATTN_OTEL_KV_WRITE=fused``, the default).  Each way is timed over ``--calls`` calls after a
warm-up, with the device synchronised only at the end (the host's time is what is measured; the launches
queue):

* ``old``: ``scatter_rows`` of the code at ``--old`` (a commit, read from git, or a folder holding that
  commit's ``triton_metrics.py`` and ``slots.py``: the GPU machine has no git), where given;
* ``wrapper``: ``scatter_rows(...)`` as the stream calls it, with ``ATTN_OTEL_LAUNCH=bound`` (the default);
* ``wrapper_jit``: the same with ``ATTN_OTEL_LAUNCH=jit`` (Triton's JIT call every time);
* ``jit``: the Triton kernel called directly with the arguments built once (``_scatter_rows[grid](...)``);
* ``bound``: the compiled kernel's own launcher with the arguments bound once (``CompiledKernel[grid](...)``),
  where this Triton has it: the floor of any wrapper.

Each way's rows (and cache, with ``kv``) are checked against the wrapper's.  Reported: microseconds a call
(median of ``--repeats`` timings) and each as a ratio to ``old`` (else to ``wrapper_jit``), in one call:

    python3 bench/launch_cost.py [--old ffbbdc2] [--calls 2000] [--repeats 7] [--out docs/benchmarks/launch-cost-h100.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OLD_FILES = ("triton_metrics.py", "slots.py")  # what the old scatter_rows imports, as a package of its own


def old_module(old: str, tmp: Path):
    """``triton_metrics`` of ``old`` (a commit read from git, or a folder holding its OLD_FILES), imported as
    the package ``attn_otel_old`` so that it sits beside this checkout's."""
    pkg = tmp / "attn_otel_old"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in OLD_FILES:
        if Path(old).is_dir():
            data = (Path(old) / name).read_bytes()
        else:
            data = subprocess.run(["git", "-C", str(ROOT), "show", f"{old}:attn_otel/{name}"], check=True,
                                  capture_output=True).stdout
        (pkg / name).write_bytes(data)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("attn_otel_old.triton_metrics")


def bound_way(tm, jit_args, jit_kw, n):
    """The compiled kernel's own launcher with its arguments bound once, or (None, why not)."""
    import torch

    compiled = tm._scatter_rows.warmup(*jit_args, grid=(n,), **jit_kw)
    runner = compiled[(n, 1, 1)]  # this launcher reads all three grid sizes
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
        return (lambda: runner(*bound_args)), label
    return None, "; ".join(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--old", help="a commit (or a folder of its triton_metrics.py and slots.py): the 'old' way")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    import triton

    from attn_otel import triton_metrics as tm

    if not torch.cuda.is_available() or not tm.available(torch.device("cuda")):
        sys.exit("launch_cost: needs a CUDA device and Triton")
    old = old_module(args.old, Path(tempfile.mkdtemp(prefix="launch-cost-"))) if args.old else None
    dev = torch.device("cuda")
    n, rows, blocks, bs, hq, hkv, d = args.tokens, 4097, 4096, 16, 32, 8, 128
    slots = blocks * bs
    ring = torch.zeros(rows + 1, hq * d, dtype=torch.bfloat16, device=dev)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=dev)  # a fused QKV output's views
    query, key, value = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    cache = torch.zeros(2, blocks, bs, hkv, d, dtype=torch.bfloat16, device=dev)  # FLASH_ATTN's layout
    kv = (key.view(n, hkv, d), value.view(n, hkv, d), cache[0], cache[1])
    slot_mapping = torch.randperm(slots, device=dev)[:n].to(torch.int64)
    table = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)
    base = torch.zeros(1, dtype=torch.int64, device=dev)

    results: dict = {}
    for case in ("ring", "ring+kv"):
        fused = kv if case == "ring+kv" else None

        def call(module, mode=None, fused=fused):
            if mode is None:
                return lambda: module.scatter_rows(ring, query, slot_mapping, rows, table=table, kv=fused, base=base)

            def way():  # the mode set in each call: the ways alternate (the same small cost in both modes)
                module.bound_launch(mode)
                module.scatter_rows(ring, query, slot_mapping, rows, table=table, kv=fused, base=base)
            return way

        ways = {}
        if old is not None:
            ways["old"] = call(old)
        ways["wrapper_jit"] = call(tm, "jit")
        ways["wrapper"] = call(tm, "bound")
        C = ring[0].numel()
        if fused is None:
            kvs, kvt, Hkv, D = (0,) * 9, (query,) * 4, 1, 1
        else:
            kc = fused[2]
            kvs = (fused[0].stride(0), fused[1].stride(0), *kc.stride()[:3], *fused[3].stride()[:3], kc.shape[1])
            kvt, Hkv, D = fused, hkv, d
        jit_args = (query, ring, slot_mapping, table, query, ring, query.stride(0), ring.stride(0), query.stride(0),
                    ring.stride(0), rows, *kvt, *kvs, base, rows)
        jit_kw = dict(C=C, C2=C, HAS_TABLE=True, PAIRS=1, BLOCK=triton.next_power_of_2(C),
                      BLOCK2=triton.next_power_of_2(C), KV=fused is not None, HKV=Hkv, D=D,
                      BH=triton.next_power_of_2(Hkv), BD=triton.next_power_of_2(D), RING=True, num_warps=4)
        ways["jit"] = lambda jit_args=jit_args, jit_kw=jit_kw: tm._scatter_rows[(n,)](*jit_args, **jit_kw)
        notes = {}
        try:
            way, note = bound_way(tm, jit_args, jit_kw, n)
            if way is not None:
                ways["bound"] = way
                notes["bound_args"] = note
            else:
                notes["bound"] = note
        except Exception as e:  # noqa: BLE001 - reported, the other ways still measured
            notes["bound"] = f"{type(e).__name__}: {e}"[:400]

        check = {}
        for name, fn in ways.items():  # each way writes the rows (and the cache) the wrapper writes
            ring.zero_()
            table.fill_(-1)
            base.zero_()
            cache.zero_()
            fn()
            torch.cuda.synchronize()
            check[name] = (ring.clone(), table.clone(), cache.clone())
        ref = check["wrapper"]
        same = {name: all(torch.equal(a, b) for a, b in zip(got, ref)) for name, got in check.items()}
        assert ref[0].abs().sum() > 0 and (fused is None or ref[2].abs().sum() > 0)

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
        tm.bound_launch("bound")
        med = {name: statistics.median(v) for name, v in us.items()}
        ref_way = "old" if "old" in med else "wrapper_jit"
        results[case] = {"us_per_call": med, "us_per_call_runs": us,
                         f"ratio_to_{ref_way}": {k: v / med[ref_way] for k, v in med.items()},
                         "rows_equal_to_wrapper": same, "notes": notes}
        print(f"{case}:")
        for name in ways:
            print(f"  {name:>11}: {med[name]:6.1f} us a call (x{med[name] / med[ref_way]:.2f} of {ref_way}'s), "
                  f"rows {'equal' if same[name] else 'DIFFER'}")
        if "bound" in notes:
            print(f"  bound: not measured ({notes['bound']})")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tokens": n, "calls": args.calls, "repeats": args.repeats, "old": args.old, "cases": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
