"""The native absorbed-MLA decode kernel (kernels/cpu/k2mla.h) against a float32 reference on
the same bf16 inputs, within the bf16 budget that the flash path is held to (error comparable
to rounding the float32 result to bf16): every path this CPU runs (AMX, AVX512-BF16), scattered
pages, page sizes that are and are not multiples of the 16-key tile, contexts from one key to
several chunks per thread, 1..8 query tokens (causal among the new tokens), 1 and 3 threads;
and TorchMLABackend's dispatch to it. Skipped where the kernel does not build or run."""

from __future__ import annotations

import pytest
import torch

from k2serve.attention.base import AttentionMetadata
from k2serve.attention.torch_ref import TorchMLABackend
from k2serve.kernels.cpu import KernelBuildError
from k2serve.kernels.cpu import mla as cpu_mla


def _paths() -> list[int]:
    try:
        return cpu_mla.mla_paths()
    except KernelBuildError:  # K2SERVE_CPU_KERNEL=native on a machine where it does not build
        return []


PATHS = _paths()
pytestmark = pytest.mark.skipif(not PATHS, reason="the native MLA kernel does not run here")


def reference(q, kv, pages, S, scale, L):
    """float32 einsums: q [n, H, E] bf16 over the first S cached rows -> [n, H, L] float32."""
    n, H, E = q.shape
    rows = kv[pages.long()].reshape(-1, E)[:S].float()  # [S, E]
    s = torch.einsum("nhe,se->nhs", q.float(), rows) * scale
    mask = torch.arange(S)[None, :] > (S - n + torch.arange(n))[:, None]  # [n, S]
    s.masked_fill_(mask[:, None], float("-inf"))
    return torch.einsum("nhs,sl->nhl", s.softmax(-1), rows[:, :L])


def case(n, H, L, R, ps, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = -(-S // ps)
    kv = torch.randn(need + 3, ps, L + R, generator=g).bfloat16()
    pages = torch.randperm(need + 3, generator=g)[:need].to(torch.int32)  # scattered
    q = (torch.randn(n, H, L + R, generator=g) * 0.5).bfloat16()
    return q, kv, pages


def within_budget(out, ref):
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    err = (out.float() - ref).abs().max().item()
    rnd = (ref.bfloat16().float() - ref).abs().max().item()
    assert err <= 3 * rnd + 1e-3, (err, rnd)


@pytest.mark.parametrize("path", PATHS, ids=[cpu_mla.PATH_NAMES[p] for p in PATHS])
@pytest.mark.parametrize(
    "n,H,L,R,ps,S",
    [(1, 64, 512, 64, 16, 1), (1, 64, 512, 64, 64, 8192), (1, 8, 64, 32, 16, 5),
     (1, 4, 128, 64, 16, 33), (1, 3, 64, 32, 7, 100), (2, 64, 512, 64, 16, 333),
     (3, 8, 64, 32, 16, 3), (4, 16, 64, 32, 1, 37), (8, 8, 128, 64, 64, 1500),
     (1, 16, 64, 32, 48, 1100), (5, 16, 64, 32, 16, 300)],
)  # fmt: skip
def test_kernel_matches_the_float32_reference(path, n, H, L, R, ps, S):
    q, kv, pages = case(n, H, L, R, ps, S)
    scale = (L + R) ** -0.5
    out = torch.full((n, H, L), float("nan"), dtype=torch.bfloat16)
    assert cpu_mla.mla_decode(q[..., :L], q[..., L:], kv, pages, S, scale, out, path) == path
    within_budget(out, reference(q, kv, pages, S, scale, L))


@pytest.mark.parametrize("path", PATHS, ids=[cpu_mla.PATH_NAMES[p] for p in PATHS])
def test_causal_verify_step_and_peaked_softmax(path, monkeypatch):
    """4 new tokens over a short context, queries large enough that the softmax is peaked
    (the running max changes from chunk to chunk); 3 threads split the keys."""
    from k2serve.kernels import cpu as ck

    lib, pool = ck._default_pool(0)
    pool3 = ck.shared_pool(lib, ((0,),), 3, 0)
    assert pool3.threads == 3
    monkeypatch.setattr(ck, "_default_pool", lambda pid: (lib, pool3))
    q, kv, pages = case(4, 64, 512, 64, 16, 2100, seed=1)
    q = (q.float() * 6).bfloat16()
    out = torch.empty(4, 64, 512, dtype=torch.bfloat16)
    assert (
        cpu_mla.mla_decode(q[..., :512], q[..., 512:], kv, pages, 2100, 576**-0.5, out, path)
        == path
    )
    within_budget(out, reference(q, kv, pages, 2100, 576**-0.5, 512))
    # token t does not see the new tokens after it: changing the last key moves only token 3
    kv2 = kv.clone()
    last = pages[2099 // 16].long()
    kv2[last, 2099 % 16] = kv2[last, 2099 % 16] * 4
    out2 = torch.empty_like(out)
    cpu_mla.mla_decode(q[..., :512], q[..., 512:], kv2, pages, 2100, 576**-0.5, out2, path)
    assert torch.equal(out[:3], out2[:3]) and not torch.equal(out[3], out2[3])


def test_unsupported_shapes_and_dtypes_fall_back():
    q, kv, pages = case(1, 8, 64, 16, 16, 40)  # E = 80: not a multiple of 32
    out = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    assert cpu_mla.mla_decode(q[..., :64], q[..., 64:], kv, pages, 40, 0.1, out) is None
    q, kv, pages = case(1, 8, 64, 32, 16, 40)
    ql, qp = q[..., :64].float(), q[..., 64:].float()
    assert cpu_mla.mla_decode(ql, qp, kv.float(), pages, 40, 0.1, out.float()) is None
    with pytest.raises(ValueError):
        cpu_mla.mla_decode(q[..., :64], q[..., 64:], kv, pages[:1], 40, 0.1, out)  # 3 needed
    bad = pages.clone()
    bad[1] = kv.shape[0]  # a page past the cache: an error, not a read out of bounds
    with pytest.raises(ValueError, match="pages"):
        cpu_mla.mla_decode(q[..., :64], q[..., 64:], kv, bad, 40, 0.1, out)


def test_backend_dispatch(monkeypatch):
    """TorchMLABackend runs the kernel for bf16 decodes and verify steps (several sequences in
    one batch), the flash path for prompts, the einsums for float32 and when told to."""
    ps, H, L, R = 16, 8, 64, 32
    ctxs, qlens = [40, 700, 0, 300], [1, 3, 1, 20]
    g = torch.Generator().manual_seed(3)
    pages_per = [-(-(c + n) // ps) for c, n in zip(ctxs, qlens, strict=True)]
    kv = torch.randn(sum(pages_per) + 1, ps, L + R, generator=g).bfloat16()
    perm = torch.randperm(kv.shape[0], generator=g).to(torch.int32)
    table = torch.zeros(len(ctxs), max(pages_per), dtype=torch.int32)
    i = 0
    for b, npg in enumerate(pages_per):
        table[b, :npg], i = perm[i : i + npg], i + npg
    T = sum(qlens)
    qsl = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in zip(ctxs, qlens, strict=True)], dtype=torch.int32),
        context_lens=torch.tensor(ctxs, dtype=torch.int32), block_table=table,
        slot_mapping=torch.zeros(T, dtype=torch.int64), max_query_len=max(qlens),
        max_seq_len=max(c + n for c, n in zip(ctxs, qlens, strict=True)), page_size=ps,
        num_decodes=2,
    )  # fmt: skip
    ql = (torch.randn(T, H, L, generator=g) * 0.3).bfloat16()
    qp = (torch.randn(T, H, R, generator=g) * 0.3).bfloat16()
    calls = []
    real = cpu_mla.mla_decode

    def spy(ql, qp, kv, pages, S, scale, out, path):
        calls.append((ql.shape[0], path))
        return real(ql, qp, kv, pages, S, scale, out, path)

    monkeypatch.setattr(cpu_mla, "mla_decode", spy)
    fast = TorchMLABackend().forward(ql, qp, kv, md, 0.2)
    # the 20-token prompt took the flash path; the verify step (a flash case) asks for AMX only
    assert [n for n, _ in calls] == [1, 3, 1] and calls[1][1] == cpu_mla.PATH_AMX
    ref = TorchMLABackend(cpu_flash=False).forward(ql.float(), qp.float(), kv, md, 0.2)
    within_budget(fast, ref)
    calls.clear()
    TorchMLABackend(cpu_kernel=False).forward(ql, qp, kv, md, 0.2)
    TorchMLABackend(cpu_flash=False).forward(ql, qp, kv, md, 0.2)
    TorchMLABackend().forward(ql.float(), qp.float(), kv.float(), md, 0.2)
    assert not calls


def test_cpu_amx_off_keeps_the_kernel_off_the_tiles(monkeypatch):
    q, kv, pages = case(1, 8, 64, 32, 16, 40)
    out = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("K2SERVE_CPU_AMX", "0")
    ql, qp = q[..., :64], q[..., 64:]
    assert cpu_mla.mla_decode(ql, qp, kv, pages, 40, 0.1, out, cpu_mla.PATH_AMX) is None
    got = cpu_mla.mla_decode(ql, qp, kv, pages, 40, 0.1, out)
    assert got == (cpu_mla.PATH_AVX512 if cpu_mla.PATH_AVX512 in PATHS else None)


def test_padding_rows_past_the_last_sequence_stay_zero():
    """The backend's output is made with empty(): rows no sequence owns (a padded batch) are
    zeroed, as with the zeros() before."""
    q, kv, pages = case(1, 8, 64, 32, 16, 40)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32),
        context_lens=torch.tensor([39], dtype=torch.int32), block_table=pages[None],
        slot_mapping=torch.zeros(3, dtype=torch.int64), max_query_len=1, max_seq_len=40,
        page_size=16, num_decodes=1,
    )  # fmt: skip
    q3 = torch.cat([q, torch.full_like(q, float("nan")), q])  # 3 rows, 1 owned
    for be in (TorchMLABackend(), TorchMLABackend(cpu_flash=False)):
        out = be.forward(q3[..., :64], q3[..., 64:], kv, md, 0.1)
        assert out.shape == (3, 8, 64) and torch.isfinite(out[0].float()).all()
        assert (out[1:] == 0).all()
