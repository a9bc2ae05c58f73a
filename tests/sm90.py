"""A Triton kernel compiled for an H100 (sm_90) on a machine without a GPU: what the interpreter does not check
(types that differ between branches, shapes a loop carries, registers), with Triton's own ptxas."""

from __future__ import annotations


def compile_sm90(fn, consts: dict, ptrs: dict, **options):
    """``fn`` (a ``triton.jit`` function) with ``consts`` as its constexprs, ``ptrs`` the types of its other
    arguments by name (``*bf16``, ``fp32``; any not named: ``i32``), compiled with ``options`` (``num_warps``,
    ``num_stages``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert set(consts) <= set(fn.arg_names), set(consts) - set(fn.arg_names)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
