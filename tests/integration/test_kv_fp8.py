"""fp8 (float8_e4m3fn) latent KV cache: close logits, per-tensor scale, twice the tokens."""

from __future__ import annotations

import logging

import pytest
import torch

import k2serve.model.backends as backends
from k2serve.attention import (
    TorchMLABackend,
    allocate_kv_caches,
    kv_cache_torch_dtype,
    make_attention_backend,
)
from k2serve.kernels.policy import KernelPolicy
from k2serve.model.backends import setup_backends
from k2serve.plan import kv_bytes_per_token

from .conftest import load_tiny, paged_logits, tiny_config

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_fp8_cache_gives_close_logits(fmt):
    model = load_tiny(fmt)
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = paged_logits(model, allocate_kv_caches(model.config, 12, 4, torch.float32), ids, 4, 30)
    setup_backends(model, kv_cache_dtype=FP8)
    caches = allocate_kv_caches(model.config, 12, 4, FP8)
    got = paged_logits(model, caches, ids, 4, 30)
    assert caches[0].dtype == FP8 and caches[0].float().abs().sum() > 0
    # Tolerance: e4m3 keeps 3 mantissa bits, so each cached value is off by at most 2^-4 of
    # itself (RMS ~2^-4/sqrt(3) ~ 3.6%). Attention averages those errors over positions and
    # heads and is one of two branches of each residual block, so the logits' relative L2
    # error must stay under the per-element bound 2^-4 (measured: ~1.5%); greedy picks agree.
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 2**-4, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_kv_scale_divides_on_store_and_multiplies_on_read():
    L, R, ps = 8, 4, 4
    x = torch.randn(6, L + R) * 3
    x[0, 0] = 1000.0  # beyond e4m3's 448: clamps at scale 1, fits at scale 4
    slots = torch.arange(6)
    for scale in (1.0, 4.0):
        be = TorchMLABackend(kv_scale=scale)
        cache = torch.zeros(2, ps, L + R, dtype=FP8)
        be.store(cache, x[:, :L], x[:, L:], slots)
        back = be._from_cache(cache.view(-1, L + R)[:6])  # float32
        stored = cache.view(-1, L + R)[0, 0].float()
        assert stored == torch.tensor(min(1000.0 / scale, 448.0)).to(FP8).float()
        # half an e4m3 ulp (2^-4 relative), or half the smallest sub-normal (2^-10) x scale
        ok = (back - x).abs() <= (x.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-6)
        assert ok.view(-1)[1:].all()
        assert bool(ok[0, 0]) == (scale == 4.0)  # 1000 clamps to 448 at scale 1
    with pytest.raises(ValueError, match="kv_scale"):
        TorchMLABackend(kv_scale=0.0)


def test_fp8_doubles_the_tokens_of_a_budget():
    cfg = tiny_config()
    bf16, fp8 = kv_bytes_per_token(cfg, "bf16"), kv_bytes_per_token(cfg, "fp8")
    assert bf16 == 2 * fp8
    ps = 16
    budget = 100 * bf16 * ps  # bytes of 100 bf16 pages
    pages = {d: budget // (kv_bytes_per_token(cfg, d) * ps) for d in ("bf16", "fp8")}
    assert pages["fp8"] == 2 * pages["bf16"]
    caches = allocate_kv_caches(cfg, pages["fp8"], ps, kv_cache_torch_dtype("fp8", torch.bfloat16))
    assert sum(c.numel() * c.element_size() for c in caches) <= budget  # planner == tensors
    assert kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


def test_fp8_cache_takes_triton_where_its_kernel_reads_fp8(monkeypatch, caplog):
    """Where Triton is usable and its MLA kernel can read fp8 (NVIDIA sm_80+), an fp8 cache gets
    the Triton backend (graph-safe); elsewhere the torch backend, with a warning."""
    import k2serve.kernels.mla_attention as mla

    monkeypatch.setattr(backends, "triton_usable", lambda device: True)
    monkeypatch.setattr(mla, "fp8_cache_supported", lambda device: True)
    choice = backends.resolve_backends("cuda", kv_cache_dtype=FP8, policy=KernelPolicy())
    assert choice.attention == "triton" and choice.kv_cache_dtype == FP8
    be = make_attention_backend(choice.attention, FP8)
    assert be.name == "triton" and be.graph_safe
    monkeypatch.setattr(mla, "fp8_cache_supported", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="k2serve.model.backends"):
        choice = backends.resolve_backends("cuda", kv_cache_dtype=FP8, policy=KernelPolicy())
    assert choice.attention == "torch" and "fp8" in caplog.text
    with pytest.raises(ValueError, match="fp8"):
        backends.resolve_backends("cuda", attention="triton", kv_cache_dtype=FP8)
    monkeypatch.undo()
    assert backends.resolve_backends("cpu", kv_cache_dtype=FP8).attention == "torch"
