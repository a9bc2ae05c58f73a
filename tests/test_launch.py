"""The bound launch's cache key (attn_otel.triton_metrics._key, _constexpr_names): what tells two launches of
one kernel apart must tell apart everything Triton compiles a kernel variant for, or a launch would run a
kernel specialised for other arguments.  The launches themselves are tested on a GPU (test_gpu_triton.py)."""

import pytest
import torch

from attn_otel import triton_metrics as tm

pytestmark = pytest.mark.skipif(tm.triton is None, reason="needs Triton importable")  # the CPU build has it


def _triton_spec():
    """Triton's own specialisation of one argument (the installed Triton's, for an sm90 target)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    return lambda a: native_specialize_impl(backend, a, False, True, True)


def _refines(values) -> None:
    """Equal keys here only where Triton's specialisations are equal: a bound launch never runs a kernel
    Triton compiled for arguments it would have told apart.  Each value alone, and in pairs."""
    triton_spec = _triton_spec()
    seen: dict = {}
    for args in [(v,) for v in values] + [(a, b) for a in values[:12] for b in values[:12]]:
        key = tm._key("kernel", (), 0, args)
        if key is not None:
            seen.setdefault(key, set()).add(tuple(triton_spec(a) for a in args))
    assert seen and all(len(s) == 1 for s in seen.values()), {k: s for k, s in seen.items() if len(s) > 1}


def test_integer_keys_refine_tritons_specialisation():
    edges = [0, 1, 2, 15, 16, 17, 32, 4096, 4097, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, (1 << 31) + 1,
             (1 << 63) - 16, (1 << 63) - 1, 1 << 63, (1 << 63) + 16, (1 << 64) - 1]
    _refines(edges + [-v for v in edges[1:] if v <= 1 << 63] + list(range(-70, 70)))


def test_tensor_keys_refine_tritons_specialisation():
    base = torch.zeros(256, dtype=torch.bfloat16)
    views = [base[8 * i:] for i in range(4)] + [torch.zeros(64, dtype=d) for d in
                                                (torch.float16, torch.float32, torch.int64, torch.int32)]
    _refines(views + [base[i:] for i in range(1, 9)])
    key = lambda *a: tm._key("kernel", (), 0, a)  # noqa: E731
    assert key(base, 16) == key(base[8:], 16) != key(base.half(), 16)  # 16 bytes in: aligned
    assert key(base[1:], 16) is None and key(base, base[1:]) is None  # 2 bytes in: Triton's JIT call
    assert key(base, 1.5) is None and key(base, True) is None  # kinds the key does not know (True: Triton's u1)
    assert key(base, 16) != key(base, 32)  # integers by value


def test_the_kernels_constexprs_come_last_as_the_launches_pass_them():
    assert tm._constexpr_names(tm._scatter_rows) == ("C", "C2", "HAS_TABLE", "PAIRS", "BLOCK", "BLOCK2", "KV",
                                                     "HKV", "D", "BH", "BD", "RING")
    assert tm._constexpr_names(tm._ring_advance) == ("BLOCK",)
    params = [p.name for p in tm._scatter_rows.params]
    assert len(params) == 26 + 12  # 26 arguments scatter_rows passes, then the 12 constexprs


def test_a_bad_launch_mode_is_refused():
    with pytest.raises(ValueError, match="bound"):
        tm.bound_launch("fast")
    tm.bound_launch("jit")
    tm.bound_launch("bound")
    assert tm._LAUNCH == ["bound"]


def test_launch_hooks_send_every_launch_through_tritons_jit():
    """A profiler's launch hook must see every launch: the bound launch stands aside while one is set (Triton
    3.6 keeps its hooks as chains that are empty when none is set; older ones as None)."""
    rt = tm.triton.knobs.runtime
    assert tm._hooks_idle()  # nothing set in this process
    hook = lambda *a: None  # noqa: E731
    chain = rt.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert not tm._hooks_idle()
        finally:
            chain.remove(hook)
    else:
        rt.launch_enter_hook = hook
        try:
            assert not tm._hooks_idle()
        finally:
            rt.launch_enter_hook = chain
    assert tm._hooks_idle()
