"""The FP8-activation grouped GEMMs (kernels/w8a8_moe.py): the e4m3 group quantization against
torch's cast, the kernel against the float32 oracle of the same quantized math (FP8-block and
INT4 experts, ragged routing, padding rows), and its error against the unquantized reference
next to the bf16 path's (the fidelity question: what FP8 activations cost)."""

import pytest
import torch

from k2serve.kernels import fused_moe as fm
from k2serve.kernels import w8a8_moe as wm
from k2serve.quant.fp8 import quantize_fp8_block
from k2serve.quant.int4 import quantize_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = {
    "BLOCK_M": 16,
    "w13": {"BLOCK_N": 128, "GROUP_M": 2, "num_warps": 4, "num_stages": 2},
    "w2": {"BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
}


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _experts(quant, E=4, D=256, I=256, seed=0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)

    def proj(n, k):
        ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(E)]
        if quant == "fp8":
            pairs = [quantize_fp8_block(w) for w in ws]
        else:
            pairs = [quantize_int4(w, 32)[:2] for w in ws]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    (gw, gs), (uw, us), (dw, ds) = proj(I, D), proj(I, D), proj(D, I)
    return fm.ExpertWeights(quant, torch.cat([gw, uw], 1).to(DEVICE), dw.to(DEVICE),
                            torch.cat([gs, us], 1).to(DEVICE), ds.to(DEVICE), 32)  # fmt: skip


def _routing(T, k, E, seed=0):
    """Expert 0 in most tokens (several row blocks), the rest random and distinct."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    for t in range((3 * T) // 4):  # expert 0 in slot 0 (distinct slots kept)
        ids[t, ids[t] == 0] = ids[t, 0]
        ids[t, 0] = 0
    w = torch.rand(T, k, generator=g)
    return ids.int().to(DEVICE), w.to(DEVICE)


def test_quant_groups_matches_torch_cast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 384, generator=g) * torch.logspace(-4, 3, 384)[None, :]
    x[3, :128] = 0.0  # an all-zero group: scale floor, zeros out
    x[5, 130] = 1e4  # one outlier sets its group's scale
    x = x.to(torch.bfloat16).to(DEVICE)
    q, s = wm.quant_fp8_groups(x)
    q_ref, s_ref = wm.quant_fp8_groups_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 3)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    if DEVICE == "cpu":  # the same fp32 division: identical values
        assert torch.equal(q.float(), q_ref.float())  # (-0 and +0 may differ)
    else:  # the GPU's approximate division may move a tie by one e4m3 step
        assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() / 8 + 2e-3).all()
    deq = (q.float().view(37, 3, 128) * s[..., None]).view(37, 384)
    assert rel(deq, x) < 0.05


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_w8a8_moe_matches_quantized_oracle(quant):
    ew = _experts(quant)
    T, k = 19, 3
    ids, w = _routing(T, k, ew.num_experts)
    x = torch.randn(T, ew.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16).to(DEVICE)
    out = wm.w8a8_moe(x, ew, w, ids, CFG)
    ref = wm.w8a8_moe_ref(x, ew, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    # same quantized values; the sums differ in order (per-K-block scaling) and bf16 output
    assert rel(out, ref) < 1e-2, rel(out, ref)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_w8a8_error_against_bf16_path(quant):
    """FP8 activations add e4m3's rounding (3 mantissa bits per value, scaled per 128): the
    output error against the unquantized float32 product is a few percent, about 10x the bf16
    path's (bf16 activations and intermediate). Bounds: not a wrong kernel (order 1) and not
    better than e4m3 allows (so the test fails if the quantization silently turned off)."""
    ew = _experts(quant, seed=2)
    T, k = 16, 2
    ids, w = _routing(T, k, ew.num_experts, seed=3)
    x = torch.randn(T, ew.hidden, generator=torch.Generator().manual_seed(4))
    x = x.to(torch.bfloat16).to(DEVICE)
    gold = fm.fused_moe_ref(x.float(), ew, w, ids)  # float32 activations and intermediate
    e_bf16 = rel(fm.fused_moe_ref(x, ew, w, ids), gold)
    e_fp8 = rel(wm.w8a8_moe(x, ew, w, ids, CFG), gold)
    assert e_bf16 < 5e-3
    assert 3 * e_bf16 < e_fp8 < 0.06, (e_fp8, e_bf16)


def test_config_and_support_checks():
    with pytest.raises(ValueError, match="BLOCK_N must be 128"):
        wm.check_config({**CFG, "w13": {**CFG["w13"], "BLOCK_N": 64}})
    with pytest.raises(ValueError, match="BLOCK_M"):
        wm.check_config({**CFG, "BLOCK_M": 24})
    assert wm.supported(_experts("fp8", E=2))
    ew = _experts("int4", E=2, D=256, I=128)
    assert wm.supported(ew)
    ew.group_size = 128
    assert not wm.supported(ew)


def test_policy_resolves_the_prompt_precision():
    import argparse
    from dataclasses import replace

    from k2serve.engine.config import EngineConfig
    from k2serve.kernels.policy import FP8_PREFILL_MIN_TOKENS, KernelPolicy

    on = KernelPolicy(triton=True)
    assert replace(on, moe_prefill_precision="bf16").moe_prefill_fp8_min_tokens() == {
        "fp8": None, "int4": None}  # fmt: skip
    fp8 = replace(on, moe_prefill_precision="fp8").moe_prefill_fp8_min_tokens()
    assert fp8 == {"fp8": FP8_PREFILL_MIN_TOKENS, "int4": FP8_PREFILL_MIN_TOKENS}
    forced = replace(on, moe_prefill_precision="fp8", moe_prefill_min_tokens=0)
    assert forced.moe_kwargs()["w8a8_min_tokens"] == {"fp8": 0, "int4": 0}
    # auto follows the device table (null there: never); no Triton: never
    table = on.tables.moe_prefill_fp8_min_tokens
    auto = replace(on, moe_prefill_precision="auto").moe_prefill_fp8_min_tokens()
    assert auto == {q: table.get(q) for q in ("fp8", "int4")}
    assert KernelPolicy(moe_prefill_precision="fp8").moe_prefill_fp8_min_tokens()["fp8"] is None
    with pytest.raises(ValueError, match="moe_prefill_precision"):
        KernelPolicy.for_device("cpu", moe_prefill_precision="int8")
    with pytest.raises(ValueError, match="moe_prefill_precision"):
        EngineConfig(moe_prefill_precision="fp16")
    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_args(ap)
    args = ap.parse_args(["--moe-prefill-precision", "fp8"])
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.moe_prefill_precision == "fp8"
    # the engine's setup hands it to the policy the backends get (decision 14: resolved once)
    from k2serve.engine.setup import choose_backends

    choice = choose_backends(cfg, torch.device("cpu"), torch.bfloat16, sharded=False)
    assert choice.policy.moe_prefill_precision == "fp8"


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_backend_runs_fp8_activations_from_the_threshold(quant):
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _experts(quant, seed=5)
    be = FusedMoEBackend(ew, w8a8_min_tokens={quant: 8})
    assert be.w8a8_min_tokens == 8
    assert FusedMoEBackend(ew, w8a8_min_tokens={"bf16": 8}).w8a8_min_tokens is None
    ids, w = _routing(8, 2, ew.num_experts, seed=6)
    x = torch.randn(8, ew.hidden, generator=torch.Generator().manual_seed(7))
    x = x.to(torch.bfloat16).to(DEVICE)
    out = be(x, ids, w)
    torch.testing.assert_close(out, wm.w8a8_moe(x, ew, w, ids), rtol=0, atol=0)
    # below the threshold the bf16-activation path: 7 tokens plan what 2 do, 2 run (cheaper)
    assert be.plan(7, 2) == be.plan(2, 2) != (("w8a8",), ())
    small = be(x[:2], ids[:2], w[:2])
    gold = fm.fused_moe_ref(x[:2].float(), ew, w[:2], ids[:2])
    assert rel(small, gold) < 0.015 < rel(out[:2], gold)
    with pytest.raises(ValueError, match="w8a8_min_tokens"):
        FusedMoEBackend(ew, w8a8_min_tokens={quant: -1})
