"""The CPU kernel's dense GEMV (kernels.cpu.cpu_linear, used by quant.linear.linear on the
CPU for decode-sized batches; cpu_head_gemv, the absorbed MLA weights per head) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k2serve.kernels import cpu as ck
from k2serve.quant.linear import linear

native = pytest.mark.skipif(ck.load_kernel("auto") is None, reason="no C++ compiler")


@native
@pytest.mark.parametrize("wdt,xdt", [(torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float32),
                                     (torch.bfloat16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("rows", sorted({1, 2, ck.LINEAR_MAX_ROWS}))
def test_cpu_linear_matches_f_linear(wdt, xdt, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=g).to(wdt)  # N not a multiple of the 32-row block
    x = torch.randn(rows, 96, generator=g).to(xdt)
    y = ck.cpu_linear(x, w)
    assert y is not None and y.dtype == xdt and y.shape == (rows, 80)
    ref = F.linear(x.float(), w.float())
    tol = 1e-2 if xdt == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(linear(x, w).float(), ref, rtol=tol, atol=tol)


@native
def test_cpu_linear_wide_output_is_rounded_the_same():
    """An output over torch's parallel grain (32,768: a fused gate_up, the lm_head) is rounded
    to bf16 by the kernel on its calling thread: the same values as one .to()."""
    g = torch.Generator().manual_seed(5)
    n = 2 * 32768 + 96  # wider than torch's grain, not a multiple of it
    w = torch.randn(n, 64, generator=g).bfloat16()
    x = torch.randn(2, 64, generator=g).bfloat16()
    y = ck.cpu_linear(x, w)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (2, n)
    assert torch.equal(y, ck._gemv(x, w, 1, 2).to(torch.bfloat16).reshape(2, n))
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


def test_cpu_linear_declines_what_it_does_not_cover():
    w = torch.randn(8, 96)
    rows = ck.LINEAR_MAX_ROWS + 1  # beyond decode-sized: torch's GEMM
    assert ck.cpu_linear(torch.randn(rows, 96), w) is None
    assert ck.cpu_linear(torch.randn(1, 40), torch.randn(8, 40)) is None  # K % 32
    assert ck.cpu_linear(torch.randn(1, 96, dtype=torch.float16), w.half()) is None
    x3 = torch.randn(2, 1, 96)  # leading dims are kept
    y = linear(x3, w)
    assert y.shape == (2, 1, 8)
    torch.testing.assert_close(y, F.linear(x3, w), rtol=1e-4, atol=1e-4)


@native
@pytest.mark.parametrize("wdt,xdt", [(torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("rows", sorted({1, 2, ck.LINEAR_MAX_ROWS}))
def test_cpu_head_gemv_matches_einsum(wdt, xdt, rows):
    g = torch.Generator().manual_seed(rows)
    H, N, K = 5, 72, 64  # N not a multiple of the 32-row block
    w = torch.randn(H, N, K, generator=g).to(wdt)
    x = torch.randn(rows, H, K + 16, generator=g).to(xdt)[..., :K]  # a strided view, as q_nope
    y = ck.cpu_head_gemv(x, w)
    assert y is not None and y.dtype == xdt and y.shape == (rows, H, N)
    ref = torch.einsum("thk,hnk->thn", x.float(), w.float())
    tol = 1e-2 if xdt == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    assert ck.cpu_head_gemv(x, w[:-1]) is None  # heads differ
    assert ck.cpu_head_gemv(torch.randn(ck.LINEAR_MAX_ROWS + 1, H, K).to(xdt), w) is None


@native
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(
    "H,N,K",
    [
        (3, 37, 128),  # W_UK^T-like rows of 128: two 16-row blocks (8 at two rows) + a tail
        (5, 20, 512),  # W_UV-like rows of 512: one block + a tail of 4
        (2, 300, 128),  # several work items per head (~32 KB of rows each), a tail item
        (7, 7, 32),  # every row a tail row, odd heads
        (4, 128, 96),  # K not a power of two
    ],
)
def test_cpu_head_gemv_blocks_and_tails(rows, H, N, K):
    """The bf16 x bf16 decode path (16 rows per reduction, items of head row ranges) on shapes
    whose heads, rows and columns leave tails, against float32 einsum."""
    g = torch.Generator().manual_seed(H * N + K + rows)
    w = torch.randn(H, N, K, generator=g).bfloat16()
    x = torch.randn(rows, H, K, generator=g).bfloat16()
    y = ck.cpu_head_gemv(x, w)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, H, N)
    ref = torch.einsum("thk,hnk->thn", x.float(), w.float())
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    # the float32 sums before the cast: exact products, only the order of the sums differs
    out = ck._gemv(x, w, H, rows)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # the kernel's bf16 rounding (to nearest even) is torch's
    assert torch.equal(y, out.to(torch.bfloat16))
    # float32 weights, bf16 rows: the per-row path, rounded after it
    y32 = ck.cpu_head_gemv(x, w.float())
    assert y32 is not None and y32.dtype == torch.bfloat16
    assert torch.equal(y32, ck._gemv(x, w.float(), H, rows).to(torch.bfloat16))
