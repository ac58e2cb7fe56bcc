"""The Gluon INT4 grouped GEMM: its switch and configs on CPU, the kernel against the Triton one
on an sm_90 GPU with Triton 3.6 (skipped elsewhere)."""

import pytest
import torch

from k2serve.kernels import int4_gemm, int4_gemm_gluon
from k2serve.kernels.int4_gemm_gluon import GLUON_TABLE, check_config, gluon_usable


def test_module_imports_without_gluon(run_without_gluon):
    """With Gluon unimportable (CPU CI: no Triton, or another Triton) both modules import and
    report the kernel unavailable."""
    run_without_gluon(
        "from k2serve.kernels import int4_gemm, int4_gemm_gluon as g\n"
        "assert not g.HAS_GLUON and not g.gluon_available() and not g.gluon_usable('cpu')\n"
        "assert int4_gemm.gemm_backend(None, 'cpu') == 'triton'\n"
        "print('ok')\n"
    )


def test_backend_selection(monkeypatch):
    """The kernel runs the backend it is given (triton when None); the engine's choice, with
    K2SERVE_INT4_GEMM, is KernelPolicy's (test_policy), never re-read here."""
    monkeypatch.setenv("K2SERVE_INT4_GEMM", "gluon")
    assert int4_gemm.gemm_backend(None, "cpu") == "triton"
    assert int4_gemm.gemm_backend("triton", "cpu") == "triton"
    with pytest.raises(RuntimeError, match="sm_90"):  # asked for where it cannot run
        int4_gemm.gemm_backend("gluon", "cpu")
    with pytest.raises(ValueError, match="backend 'tilelang'"):
        int4_gemm.gemm_backend("tilelang", "cpu")
    monkeypatch.setattr(int4_gemm, "gluon_usable", lambda device: True)
    assert int4_gemm.gemm_backend("gluon", "cuda") == "gluon"
    monkeypatch.setenv("K2SERVE_INT4_GEMM", "triton")
    assert int4_gemm.gemm_backend("gluon", "cuda") == "gluon"


def test_check_config():
    # the kernel's own default is the tuned table's values (the engine uses the table)
    from k2serve.kernels.policy import load_tables

    assert [dict(e) for e in GLUON_TABLE] == [
        {k: v for k, v in e.items() if k != "what"} for e in load_tables().int4_prefill_gluon
    ]
    for e in GLUON_TABLE:
        check_config({k: v for k, v in e.items() if k != "max_pairs"})
    ok = dict(BLOCK_M=64, BLOCK_N=128, W2=16, STAGES=4, num_warps=4)
    check_config(ok)
    for bad in (
        dict(BLOCK_M=12),  # not a multiple of 8
        dict(BLOCK_N=64, num_warps=8),  # two warpgroups need 128 rows
        dict(num_warps=2),  # wgmma: whole warpgroups
        dict(STAGES=2),  # the ring needs 2 slots of slack
        dict(BLOCK_M=256, STAGES=6),  # 6 * 74 KiB of shared memory
    ):
        with pytest.raises(ValueError):
            check_config({**ok, **bad})


def test_env_gluon_on_cpu_runs_the_triton_kernel(monkeypatch):
    """K2SERVE_INT4_GEMM=gluon where Gluon cannot run: the Triton kernel's (right) result."""
    if torch.cuda.is_available():
        pytest.skip("the fallback is exercised on CPU (the interpreter)")
    pytest.importorskip("triton")
    from k2serve.kernels import fused_moe as fm

    torch.manual_seed(0)
    E, D, I = 3, 256, 256  # noqa: E741
    pk = lambda n, k: torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32)  # noqa: E731
    sc = lambda n, k: (torch.rand(E, n, k // 32) * 0.004 + 0.002).bfloat16()  # noqa: E731
    ew = fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)
    T, k = 6, 2
    x = torch.randn(T, D, dtype=torch.bfloat16)
    w = torch.rand(T, k)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    monkeypatch.setenv("K2SERVE_INT4_GEMM", "gluon")
    cfg = dict(BLOCK_M=16, BLOCK_N=64, W2=16, num_warps=4, num_stages=2)
    out = int4_gemm.int4_moe_gemm(x, ew, w, ids, cfg)
    ref = fm.fused_moe_ref(x, ew, w, ids)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_usable("cuda"), reason="needs an sm_90 GPU and Triton 3.6 Gluon")
@pytest.mark.parametrize("T", [5, 300])
@pytest.mark.parametrize(
    "cfg",
    [
        None,
        dict(BLOCK_M=16, BLOCK_N=64, W2=16, STAGES=3, num_warps=4),
        # the wave-8 keys: L1, KW (=2 falls back to 1 for K=768), TAIL, SILU
        dict(BLOCK_M=64, BLOCK_N=256, W2=16, STAGES=4, num_warps=8, BF16X2=True, L1=True),
        dict(
            BLOCK_M=128,
            BLOCK_N=256,
            W2=16,
            STAGES=3,
            num_warps=8,
            BF16X2=True,
            L1=True,
            SILU=True,
            TAIL=True,
        ),
        dict(BLOCK_M=64, BLOCK_N=256, W2=16, STAGES=4, num_warps=8, BF16X2=True, KW=2, TAIL=True),
    ],
)
def test_gluon_matches_triton(T, cfg):
    from k2serve.kernels import fused_moe as fm

    torch.manual_seed(T)
    E, D, I, k = 8, 768, 512, 4  # noqa: E741
    dev = "cuda"
    pk = lambda n, kk: torch.randint(
        -(2**31), 2**31 - 1, (E, n, kk // 8), dtype=torch.int32, device=dev
    )  # noqa: E731, E501
    sc = lambda n, kk: (torch.rand(E, n, kk // 32, device=dev) * 0.004 + 0.002).bfloat16()  # noqa: E731
    ew = fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=dev)
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int().to(dev)  # E-1: none
    ref = fm.fused_moe_ref(x, ew, w, ids).float()
    tri = int4_gemm.int4_moe_gemm(x, ew, w, ids, backend="triton").float()
    glu = int4_gemm.int4_moe_gemm(x, ew, w, ids, cfg, backend="gluon").float()
    e_tri = ((tri - ref).norm() / ref.norm()).item()
    e_glu = ((glu - ref).norm() / ref.norm()).item()
    assert torch.isfinite(glu).all()
    assert e_glu < max(2 * e_tri, 1e-3), (e_glu, e_tri)
    assert int4_gemm_gluon.gluon_available()


def test_policy_picks_gluon_only_where_it_runs(monkeypatch, caplog):
    from k2serve.kernels import policy as pol

    monkeypatch.delenv("K2SERVE_INT4_GEMM", raising=False)
    t = pol.load_tables()
    assert t.int4_prefill_gluon and t.int4_prefill_gluon_min_tokens is None
    for e in t.int4_prefill_gluon:
        check_config(dict(e))
    bands = [e["max_pairs"] for e in t.int4_prefill_gluon]
    assert bands[-1] is None and bands[:-1] == sorted(bands[:-1])
    # the CPU: the tables name the Gluon configs, the device cannot run them
    assert pol.pick_int4_gemm_backend(None, t, "cpu") == "triton"
    assert pol.KernelPolicy.for_device("cpu").int4_gemm_backend == "triton"
    with caplog.at_level("WARNING"):
        assert pol.pick_int4_gemm_backend("gluon", t, "cpu") == "triton"
    assert "Gluon" in caplog.text
    with pytest.raises(ValueError, match="cutlass"):
        pol.pick_int4_gemm_backend("cutlass", t, "cpu")
    # where it runs: the tables' choice unless told otherwise
    monkeypatch.setattr(int4_gemm_gluon, "gluon_usable", lambda device: True)
    assert pol.pick_int4_gemm_backend(None, t, "cuda") == "gluon"
    assert pol.pick_int4_gemm_backend("triton", t, "cuda") == "triton"
    no_gluon = pol.KernelTables.from_json("x", {**_h100_json(), "int4_prefill_gluon": []})
    assert pol.pick_int4_gemm_backend(None, no_gluon, "cuda") == "triton"


def _h100_json() -> dict:
    import json
    from importlib import resources

    return json.loads(resources.files("k2serve.kernels").joinpath("configs/h100.json").read_text())


def test_moe_backend_with_gluon_takes_its_table_and_never_grouped_mm():
    from dataclasses import replace

    from k2serve.kernels.fused_moe import ExpertWeights
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    E, D, I = 384, 7168, 2048  # noqa: E741
    m = "meta"
    ew = ExpertWeights("int4", torch.empty(E, 2 * I, D // 8, dtype=torch.int32, device=m),
                       torch.empty(E, D, I // 8, dtype=torch.int32, device=m),
                       torch.empty(E, 2 * I, D // 32, device=m),
                       torch.empty(E, D, I // 32, device=m))  # fmt: skip
    pol = KernelPolicy.reference()
    triton_be = FusedMoEBackend(ew, **pol.moe_kwargs())
    gluon_kw = replace(pol, int4_gemm_backend="gluon").moe_kwargs()
    gluon_be = FusedMoEBackend(ew, **gluon_kw)
    assert triton_be.gemm_backend == "triton" and gluon_be.gemm_backend == "gluon"
    assert gluon_be.prefill_config == pol.tables.int4_prefill_gluon
    assert triton_be.plan(16384, 8)[0] == ("grouped_mm",)
    assert gluon_be.plan(16384, 8)[0] == ("gemm",) and gluon_be.plan(65536, 8)[0] == ("gemm",)
    assert gluon_be.plan(1, 8)[0] == triton_be.plan(1, 8)[0]  # decode paths are unchanged
    # wave 12's [gemm_narrow, gemm] band: the narrow tile went in wave 13, and its path with it
    narrow = dict(min_pairs=4097, max_pairs=9215, paths=["gemm_narrow", "gemm"],
                  pairs_per_expert=[24.0])  # fmt: skip
    with pytest.raises(ValueError, match="int4_routing_select entry"):
        FusedMoEBackend(ew, **{**gluon_kw, "routing_select": [narrow]})
    with pytest.raises(ValueError, match="gemm_backend"):
        FusedMoEBackend(ew, gemm_backend="cutlass")


@pytest.mark.parametrize(
    "T,E,k,bm", [(1, 4, 2, 16), (37, 5, 2, 32), (1024, 384, 8, 128), (300, 9, 3, 64)]
)
def test_tail_units_cover_every_block_once(T, E, k, bm):
    """TAIL's program rows (on CPU, the alignment's torch reference): every aligned block of
    bm / 2 rows in use is run exactly once, by a unit at an even place in its expert's blocks,
    as a bm tile with the next block where that is the same expert's, else alone; an expert's
    units are adjacent and in order; the rest of the grid is the no-work sentinel."""
    from k2serve.kernels.moe_align import max_blocks, moe_align_block_size_ref

    torch.manual_seed(T + E)
    ids = torch.randint(0, E - 1, (T, k), dtype=torch.int32)  # expert E - 1: no pairs
    ids[: T // 3] = 0  # one expert with many pairs
    _, eids, npost = moe_align_block_size_ref(ids, E, bm // 2)
    nb, n_units = eids.shape[0], max_blocks(T * k, E, bm)
    units = int4_gemm_gluon.tail_units(eids, E, n_units)
    assert units.dtype == torch.int32 and units.shape == (n_units,)
    used = int(npost) // (bm // 2)
    real = [int(b) for b in units if b < nb]
    assert all(int(b) == nb for b in units[len(real) :])  # sentinels only after the units
    assert real == sorted(real) and all(b * (bm // 2) < int(npost) for b in real)
    covered = []
    for b in real:
        first = b
        while first > 0 and eids[first - 1] == eids[b]:
            first -= 1
        assert (b - first) % 2 == 0
        full = b + 1 < used and eids[b + 1] == eids[b]
        covered += [b, b + 1] if full else [b]
    assert covered == list(range(used))
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    assert len(real) == int(((counts + bm - 1) // bm).sum())  # cdiv(pairs, bm) an expert


def test_tail_config_and_alignment():
    check_config(dict(BLOCK_M=128, BLOCK_N=256, W2=16, STAGES=4, num_warps=8, TAIL=True))
    with pytest.raises(ValueError, match="TAIL"):
        check_config(dict(BLOCK_M=24, BLOCK_N=128, W2=16, STAGES=4, num_warps=4, TAIL=True))
    assert int4_gemm_gluon.align_m(dict(BLOCK_M=128, TAIL=True)) == 64
    assert int4_gemm_gluon.align_m(dict(BLOCK_M=128)) == 128


def test_l1_carveout_keeps_the_occupancy():
    from k2serve.kernels.int4_gemm_gluon import carveout_pct

    kib = 228 * 1024
    # 128x256 STAGES=3 (156 KiB, one CTA of 254 registers x 256 threads): 164 KiB -> 92 of L1
    assert 0.68 * kib < carveout_pct(159744, 254 * 256) * kib / 100 < 0.73 * kib
    # two CTAs fit by registers and shared memory: room for both
    assert carveout_pct(86016, 126 * 128) * kib / 100 >= 2 * (86016 + 1024)
    assert carveout_pct(232448, 1) == 100  # the most there is


def test_kw_config():
    kw = dict(BLOCK_M=128, BLOCK_N=256, W2=16, STAGES=3, num_warps=8, KW=True)
    check_config(kw)  # 96 KiB of activations + 2 K-step slots of 36 KiB
    assert int4_gemm_gluon.smem_bytes(kw) == 3 * 32768 + 2 * (32768 + 4096)
    with pytest.raises(ValueError):
        check_config({**kw, "STAGES": 4})  # 3 K-step slots: 236 KiB
    with pytest.raises(ValueError, match="KW and L1"):
        check_config({**kw, "L1": True})
    kw2 = {**kw, "KW": 2}  # 4 scale slots of K-step pairs
    check_config(kw2)
    assert int4_gemm_gluon.smem_bytes(kw2) == 3 * 32768 + 2 * 32768 + 4 * 4096
    with pytest.raises(ValueError, match="KW must be"):
        check_config({**kw, "KW": 3})


def test_int4_moe_gemm_passes_tail_units_to_the_gluon_launch(monkeypatch):
    """A TAIL table entry: int4_moe_gemm aligns to BLOCK_M / 2 and hands both launches the
    units (the kernel itself runs on an sm_90 GPU: test_gluon_matches_triton, the device
    script)."""
    if torch.cuda.is_available():
        pytest.skip("the wiring is checked on CPU")
    pytest.importorskip("triton")
    from k2serve.kernels import fused_moe as fm
    from k2serve.kernels.moe_align import max_blocks

    calls, shapes = [], []

    def fake(a, w, s, c, tw, sid, eids, npost, N, K, M, a_div, mul_w, perm_out, cfg, units=None):
        calls.append((sid.shape[0], eids.shape[0], None if units is None else units.shape[0]))
        shapes.append((tuple(a.shape), tuple(c.shape)))
        c.zero_()

    monkeypatch.setattr(int4_gemm, "gluon_usable", lambda device: True)
    monkeypatch.setattr(int4_gemm, "gemm_gluon", fake)
    torch.manual_seed(0)
    E, D, I, T, k = 4, 256, 256, 40, 2  # noqa: E741
    pk = lambda n, kk: torch.randint(-(2**31), 2**31 - 1, (E, n, kk // 8), dtype=torch.int32)  # noqa: E731
    sc = lambda n, kk: (torch.rand(E, n, kk // 32) * 0.004 + 0.002).bfloat16()  # noqa: E731
    ew = fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)
    x = torch.randn(T, D, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    cfg = dict(BLOCK_M=32, BLOCK_N=128, W2=16, STAGES=3, num_warps=4, TAIL=True, KW=True)
    int4_gemm.int4_moe_gemm(x, ew, torch.rand(T, k), ids, cfg, backend="gluon")
    nb = max_blocks(T * k, E, 16)
    assert calls == [(nb * 16, nb, max_blocks(T * k, E, 32))] * 2
    calls.clear()
    int4_gemm.int4_moe_gemm(x, ew, torch.rand(T, k), ids, {**cfg, "TAIL": False}, backend="gluon")
    assert calls == [(max_blocks(T * k, E, 32) * 32, max_blocks(T * k, E, 32), None)] * 2
    # SILU: the gate_up launch writes the [pairs, I] activation the down launch reads
    shapes.clear()
    int4_gemm.int4_moe_gemm(x, ew, torch.rand(T, k), ids, {**cfg, "SILU": True}, backend="gluon")
    assert shapes == [((T, D), (T * k, I)), ((T * k, I), (T * k, D))]
