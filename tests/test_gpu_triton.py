"""The fused Triton metrics kernel equals the torch reference (attn_otel.attention.attention_metrics)."""

import pytest
import torch

from attn_otel.attention import attention_metrics

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, N, hq, hkv, d, vision", [
    (1, 1, 4, 2, 64, False), (5, 3, 4, 2, 64, False), (130, 70, 8, 2, 64, True), (767, 511, 32, 8, 128, False),
    (2100, 2000, 32, 8, 128, True),
])
def test_fused_kernel_matches_torch(T, N, hq, hkv, d, vision):
    from attn_otel import triton_metrics

    g = torch.Generator(device="cuda").manual_seed(T)
    q = (torch.randn(T, hq, d, device="cuda", generator=g) * 1.5).bfloat16()
    k = (torch.randn(T, hkv, d, device="cuda", generator=g) * 1.5).bfloat16()
    vm = (torch.rand(T, device="cuda", generator=g) < 0.3) if vision else None
    scale = d ** -0.5
    ref = attention_metrics(q, k, scale, N, 4, vm)
    got = triton_metrics.row_metrics(q[None], k[None], scale, N, 4, vm)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    err = (got[ok] - ref[ok]).abs().max().item() if ok.any() else 0.0
    assert err < 2e-4, err
