"""Start-up warm-up (engine.warmup): the steps it runs reach every kernel configuration the
MoE dispatch can pick, and a new kernel-table field cannot be added without being classified."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from k2serve.engine.warmup import (
    config_key,
    run_warmup,
    warmup_steps,
    warmup_token_counts,
)
from k2serve.kernels.fused_moe import ExpertWeights
from k2serve.kernels.policy import KernelPolicy, KernelTables
from k2serve.moe.fused_moe import FusedMoEBackend

E, D, I, TOP_K = 384, 7168, 2048, 8  # noqa: E741 - K2's routed experts
MAX_TOKENS = 16384


def k2_experts(quant: str) -> ExpertWeights:
    """K2-shaped expert tensors on the meta device (only shapes are read)."""
    m = "meta"
    if quant == "int4":
        return ExpertWeights("int4", torch.empty(E, 2 * I, D // 8, dtype=torch.int32, device=m),
                             torch.empty(E, D, I // 8, dtype=torch.int32, device=m),
                             torch.empty(E, 2 * I, D // 32, device=m),
                             torch.empty(E, D, I // 32, device=m))  # fmt: skip
    if quant == "fp8":
        f8 = torch.float8_e4m3fn
        return ExpertWeights("fp8", torch.empty(E, 2 * I, D, dtype=f8, device=m),
                             torch.empty(E, D, I, dtype=f8, device=m),
                             torch.empty(E, 2 * I // 128, D // 128, device=m),
                             torch.empty(E, D // 128, I // 128, device=m))  # fmt: skip
    return ExpertWeights("bf16", torch.empty(E, 2 * I, D, device=m), torch.empty(E, D, I, device=m))


def backend(quant: str, **changes) -> FusedMoEBackend:
    return FusedMoEBackend(
        k2_experts(quant), **{**KernelPolicy.reference().moe_kwargs(), **changes}
    )


def reachable(backends, max_tokens=MAX_TOKENS) -> set:
    return {config_key(backends, t, TOP_K) for t in range(1, max_tokens + 1)}


@pytest.mark.parametrize(
    "quant, changes",
    [("int4", {}), ("fp8", {}), ("fp8", {"fp8_impl": "gemm"}), ("bf16", {}),
     ("int4", {"prefill_impl": "gemm"})],
)  # fmt: skip
def test_warmup_reaches_every_config_the_dispatch_can_pick(quant, changes):
    bes = [backend(quant, **changes)]
    counts = warmup_token_counts(bes, TOP_K, MAX_TOKENS)
    assert {config_key(bes, t, TOP_K) for t in counts} == reachable(bes)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] <= MAX_TOKENS


def test_every_shipped_table_entry_is_warmed():
    """Each INT4 GEMM config, each routing band, the per-pair and grouped GEMVs and the
    grouped_mm prefill; with fp8_impl="gemm" each FP8 GEMM config."""
    t = KernelPolicy.reference().tables
    int4 = backend("int4")
    keys = {config_key([int4], n, TOP_K) for n in warmup_token_counts([int4], TOP_K, MAX_TOKENS)}
    picks = {p for k in keys for p in k[0][0]}
    assert {("gemm", i) for i in range(len(t.int4_prefill))} <= picks
    assert {("decode",), ("grouped",), ("grouped_mm",)} <= picks
    for band in t.int4_routing_select:  # every candidate of every band is launched
        n = band["min_pairs"] // TOP_K + 1
        assert {p[0] for p in config_key([int4], n, TOP_K)[0][0]} == set(band["paths"])
    gluon = backend("int4", gemm_backend="gluon", prefill_config=None, prefill_min_tokens=None)
    assert gluon.prefill_config == t.int4_prefill_gluon
    keys = {config_key([gluon], n, TOP_K) for n in warmup_token_counts([gluon], TOP_K, MAX_TOKENS)}
    picks = {p for k in keys for p in k[0][0]}
    # the first entry (<= 2048 pairs) is not reached on group-32 experts, whose decode-sized
    # steps the mma path and the routing bands take; without them it is (next assertion)
    assert {("gemm", i) for i in range(1, len(t.int4_prefill_gluon))} <= picks
    no_mma = backend("int4", gemm_backend="gluon", prefill_config=None, prefill_min_tokens=None,
                     mma_config={})  # fmt: skip
    keys = {config_key([no_mma], n, TOP_K) for n in warmup_token_counts([no_mma], TOP_K, 4096)}
    assert ("gemm", 0) in {p for k in keys for p in k[0][0]}
    assert t.int4_prefill_gluon_min_tokens is None and ("grouped_mm",) not in picks
    fp8 = backend("fp8", fp8_impl="gemm")
    keys = {config_key([fp8], n, TOP_K) for n in warmup_token_counts([fp8], TOP_K, MAX_TOKENS)}
    assert {p for k in keys for p in k[0][0]} == {("fp8_gemm", i) for i in range(len(t.fp8_moe))}
    # the FP8 band where Gluon does not run: every candidate, the kernel with small-M blocks,
    # at every pair count; where it runs the Gluon GEMM from its min pairs, ahead of the band
    fp8 = backend("fp8")
    kept = fp8.fp8_routing_select
    assert kept and all(b in t.fp8_routing_select for b in kept)
    counts = {config_key([fp8], c, TOP_K) for c in warmup_token_counts([fp8], TOP_K, 1024)}
    for n in range(kept[0]["min_pairs"] // TOP_K + 1, kept[-1]["max_pairs"] // TOP_K + 1):
        band = next(b for b in kept if b["min_pairs"] <= n * TOP_K <= b["max_pairs"])
        key = config_key([fp8], n, TOP_K)
        assert {p[0] for p in key[0][0]} == set(band["paths"])
        assert ("kernel", 16) in key[0][0] and key in counts
    with_gluon = backend("fp8", fp8_gluon_min_pairs=t.fp8_prefill_gluon_min_pairs)
    assert with_gluon.plan(300, TOP_K) == (("fp8_gluon",), ())
    assert "fp8_gemm" in fp8.plan(300, TOP_K)[0]


# Every KernelTables field and what warms it. A new field (a new kernel or launch config the
# policy can pick) fails this test until engine.warmup covers it and it is listed here.
TABLE_FIELDS = {
    "kind": "not a config",
    "gemv_bf16": "one shape per projection, batch 1: the decode graphs and every warm-up step",
    "fp8_linear": "two row classes (<=16, <=64): warm-up counts 1 and the decode graphs",
    "fp8_kernel_max_rows": "the row limit of fp8_linear",
    "int4_decode": "config_key path 'decode'",
    "int4_decode_max_pairs": "FusedMoEBackend.plan",
    "int4_prefill": "config_key ('gemm', entry)",
    "int4_prefill_min_tokens": "config_key path 'grouped_mm'",
    "side_stream_max_tokens": "no kernel of its own",
    "fp8_moe": "config_key ('fp8_gemm', entry)",
    "fp8_moe_generic_max_pairs": "FusedMoEBackend.plan",
    "mla_decode": "the decode graphs (CUDA graph capture)",
    "int4_decode_grouped": "config_key path 'grouped'",
    "int4_decode_grouped_min_pairs": "FusedMoEBackend.plan",
    "int4_decode_grouped_max_pairs": "FusedMoEBackend.plan",
    "int4_routing_select": "config_key: every path of a band",
    "int4_decode_mma": "config_key path 'mma' (tests/kernels/test_int4_moe_mma16.py)",
    "int4_decode_mma_min_pairs": "FusedMoEBackend.plan",
    "int4_decode_mma_max_pairs": "FusedMoEBackend.plan",
    "moe_prefill_fp8_min_tokens": "FusedMoEBackend.plan: path 'w8a8' from that many tokens",
    "int4_prefill_gluon": "config_key ('gemm', entry) with gemm_backend='gluon'",
    "int4_prefill_gluon_min_tokens": "config_key path 'grouped_mm' with gemm_backend='gluon'",
    "fp8_prefill_gluon": "config_key ('fp8_gluon', entry) (tests/kernels/test_fp8_gemm_gluon.py)",
    "fp8_prefill_gluon_min_pairs": "FusedMoEBackend.plan: path 'fp8_gluon' where Gluon runs",
    "fp8_routing_select": "config_key: every path of a band (the kernel's small-M blocks)",
    "mla_prefill": "the warm-up's prompt steps (one sequence up to the budget: every max_len band)",
}


def test_new_table_fields_must_be_warmed():
    assert {f.name for f in fields(KernelTables)} == set(TABLE_FIELDS)


def test_warmup_steps_and_a_cpu_run(tiny_ckpt):
    """The steps' metadata is what the runner builds (slots inside each sequence's pages,
    decodes first); on the tiny model (torch experts: no config keys) the run completes."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.engine.warmup import step_inputs
    from k2serve.weights.loader import load_model

    steps = warmup_steps([1, 5, 40], page_size=16, max_tokens=64)
    assert warmup_steps([40], 16, 64, max_len=16)[0].new_tokens == (16, 16, 8)
    assert steps[-1].new_tokens == (1, 16) and steps[-2].context == (16,)
    ids, pos, md, used = step_inputs(steps[-1], 16, "cpu")
    assert md.num_decodes == 1 and md.query_start_loc.tolist() == [0, 1, 17]
    assert pos[0].item() == 16 and used == 3
    assert (md.slot_mapping // 16 < used).all()
    model = load_model(tiny_ckpt(), device="cpu", progress=False)
    caches = allocate_kv_caches(model.config, 8, 16, torch.float32, "cpu")
    assert run_warmup(model, caches, page_size=16, max_num_batched_tokens=64, max_model_len=32) >= 0


def test_attention_bands_get_a_prompt_each():
    """The MLA prompt kernel's configs are picked by the step's longest prompt: the warm-up
    runs one prompt past each band edge that the budget and max_model_len allow."""
    from types import SimpleNamespace as NS

    from k2serve.engine.warmup import attention_token_counts

    def model(attn, cfgs):
        be = NS(prefill_attn=attn, prefill_configs=cfgs)
        return NS(model=NS(layers=[NS(self_attn=NS(backend=be))]))

    cfgs = ({"max_len": 1024}, {"max_len": 4096}, {"max_len": None})
    assert attention_token_counts(model("triton", cfgs), 8192) == [1025, 4097]
    assert attention_token_counts(model("triton", cfgs), 2048) == [1025]
    assert attention_token_counts(model("triton", cfgs), 8192, max_len=1000) == []
    assert attention_token_counts(model("sdpa", cfgs), 8192) == []
