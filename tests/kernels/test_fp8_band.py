"""FP8-block experts chosen on the device from the routing: the `active` flag of the generic
kernel (kernels/fused_moe.py) and the grouped GEMMs (kernels/fp8_moe.py), and FusedMoEBackend's
`fp8_routing_select` bands (the policy's table of the same name)."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_fp8_moe import DEVICE, _experts, _ragged_routing, rel

from k2serve.kernels import fp8_moe
from k2serve.kernels import fused_moe as fm

SENTINEL = 0.5  # what the spy writes into every GEMM output before the launch


def _spy_outputs(monkeypatch, mod):
    """Fill each GEMM launch's output with SENTINEL first: an inactive launch leaves it."""
    real = mod._gemm

    def spy(a, w, s, c, *rest, **kw):
        c.fill_(SENTINEL)
        return real(a, w, s, c, *rest, **kw)

    monkeypatch.setattr(mod, "_gemm", spy)


@pytest.mark.parametrize("path", ["kernel", "fp8_gemm"])
def test_inactive_fp8_paths_do_no_work(path, monkeypatch):
    """active = 0: every program returns at once (no output row written: the top-k sum of
    the untouched outputs); active = 1: the result without the flag, bit for bit."""
    ew = _experts(4, 128, 128)
    T, k = 6, 2
    ids, w = _ragged_routing(T, k, 4)
    x = torch.randn(T, 128, device=DEVICE, dtype=torch.bfloat16)
    if path == "kernel":
        cfg = fm.kernel_config(1, 4, "fp8")  # the small-M blocks

        def run(active=None):
            return fm.fused_moe(x, ew, w, ids, cfg, active)

        _spy_outputs(monkeypatch, fm)
    else:
        cfg = dict(fp8_moe.pick_config(T * k), BLOCK_M=16)

        def run(active=None):
            return fp8_moe.fp8_moe(x, ew, w, ids, cfg, active=active)

        _spy_outputs(monkeypatch, fp8_moe)
    plain = run()
    assert rel(plain, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2
    off = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert (run(off) == SENTINEL * k).all()
    on = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(run(on), plain)


def _band_backend(**kw):
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _experts(8, 128, 128)
    band = dict(min_pairs=8, max_pairs=16, paths=["kernel", "fp8_gemm"], pairs_per_expert=[3.0])
    args = {**KernelPolicy.reference().moe_kwargs(), "fp8_generic_max_pairs": 4,
            "fp8_routing_select": [band], **kw}  # fmt: skip
    return ew, FusedMoEBackend(ew, **args)


def test_fp8_band_picks_by_pairs_per_expert(chosen_paths):
    """Inside a band both candidates are launched and the output is the chosen one's: spread
    routing (1 pair per hit expert) -> the generic kernel with its small-M blocks,
    concentrated (4) -> the grouped GEMMs; each equal to the chosen path run alone. Outside
    the band: the pair-count rule."""

    ew, be = _band_backend()
    assert be.plan(4, 2) == (("kernel", "fp8_gemm"), (3.0,))
    assert be.plan(2, 2) == (("kernel",), ()) and be.plan(9, 2) == (("fp8_gemm",), ())
    # the band's kernel candidate runs small-M blocks past fp8_generic_max_pairs (config_key)
    assert be.kernel_config(8)["BLOCK_M"] == 16 and be.kernel_config(18)["BLOCK_M"] == 128
    assert be.config_key(4, 2)[0] == (("kernel", 16), ("fp8_gemm", 0))
    chosen = chosen_paths
    for ids, path in (([[0, 1], [2, 3], [4, 5], [6, 7]], "kernel"),
                      ([[0, 1], [1, 0], [0, 1], [1, 0]], "fp8_gemm")):  # fmt: skip
        ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        x = torch.randn(4, 128, device=DEVICE, dtype=torch.bfloat16)
        w = torch.rand(4, 2, device=DEVICE)
        out = be(x, ids, w)
        assert torch.equal(out, be.run_path(path, x, ids, w))
        assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2
    assert chosen == [0, 1]


def test_fp8_bands_checked_at_setup_and_only_where_they_run():
    """A malformed band fails at setup; a band of the Gluon GEMM is dropped where it does not
    run; fp8_impl "gemm" / "kernel" ignore the bands."""
    gluon = dict(min_pairs=8, max_pairs=16, paths=["kernel", "fp8_gluon"], pairs_per_expert=[3])
    for bad in (
        dict(min_pairs=8, max_pairs=16, paths=["kernel", "gemm"], pairs_per_expert=[3.0]),
        dict(min_pairs=8, max_pairs=16, paths=["kernel", "fp8_gemm"], pairs_per_expert=[]),
        dict(min_pairs=16, max_pairs=8, paths=["kernel", "fp8_gemm"], pairs_per_expert=[3.0]),
        dict(min_pairs=8, paths=["kernel", "fp8_gemm"], pairs_per_expert=[3.0]),
    ):
        with pytest.raises(ValueError, match="fp8_routing_select"):
            _band_backend(fp8_routing_select=[bad])
    assert _band_backend(fp8_routing_select=[gluon])[1].fp8_routing_select == ()
    be = _band_backend(fp8_routing_select=[gluon], fp8_gluon_min_pairs=12)[1]
    assert be.plan(4, 2) == (("kernel", "fp8_gluon"), (3,))
    assert _band_backend(fp8_impl="gemm")[1].plan(4, 2) == (("fp8_gemm",), ())


def test_shipped_fp8_bands_reach_the_backend():
    """The policy's fp8_routing_select reaches FusedMoEBackend through moe_kwargs()."""
    from k2serve.kernels.policy import KernelPolicy, load_tables

    bands = load_tables().fp8_routing_select
    assert bands and all("kernel" in b["paths"] for b in bands)
    kw = KernelPolicy.reference().moe_kwargs()
    assert kw["fp8_routing_select"] == bands


def test_band_benchmark_part_on_cpu(monkeypatch, capsys):
    """benchmarks/fp8_moe.py --parts band at toy sizes on the CPU (timer stubbed): every row
    is checked (auto against the path it chose) and printed, both candidates are chosen."""
    import dataclasses
    import os
    import sys

    from k2serve.kernels.policy import KernelPolicy

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench)
    try:
        import fp8_moe as fb
        import model_speed as ms
    finally:
        sys.path.remove(bench)
    for k, v in dict(E=9, D=128, I=128, K=2, DEV=DEVICE).items():
        monkeypatch.setattr(fb, k, v)
    monkeypatch.setattr(ms, "graph_ms", lambda fns, reps=20: [f() for f in fns] and 1.0)
    monkeypatch.setattr(ms, "FAILS", [])
    band = dict(min_pairs=8, max_pairs=16, paths=["kernel", "fp8_gemm"], pairs_per_expert=[2.5])
    p = KernelPolicy.reference()
    p = dataclasses.replace(p, tables=dataclasses.replace(p.tables, fp8_routing_select=(band,)))
    torch.manual_seed(0)
    fb.part_band(fb.make_experts(DEVICE), p, ts=(4, 6))
    out = capsys.readouterr().out
    assert ms.FAILS == [] and out.count("  ok") == 4
    rows = [r for r in out.splitlines() if r.split("] ")[-1].startswith("| 4 |")]
    assert len(rows) == 2 and "| kernel+fp8_gemm | kernel |" in rows[0]
    assert "| kernel+fp8_gemm | fp8_gemm |" in rows[1]  # 8 pairs on 3 experts
