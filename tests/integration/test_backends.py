"""Backend choice (attention / experts / RMSNorm), the float32 router and the fused residual."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from k2serve.attention import allocate_kv_caches
from k2serve.engine.config import EngineConfig
from k2serve.kernels.policy import KernelPolicy
from k2serve.model.backends import resolve_backends, restrict_policy, setup_backends

from .conftest import load_tiny, needs_cuda, paged_logits


def test_cpu_defaults_to_torch_references_and_says_so(caplog):
    """On the CPU: torch attention / norm, the CPU expert backend for the routed experts."""
    model = load_tiny()
    with caplog.at_level("INFO", logger="k2serve.model.backends"):
        line = setup_backends(model)
    assert "attention=torch" in line and "moe=cpu" in line and "rms_norm=torch" in line
    assert line in caplog.text
    assert all(layer.self_attn.backend.name == "torch" for layer in model.model.layers)


@pytest.mark.parametrize("kw", [dict(attention="triton"), dict(moe="triton"), dict(norm="triton")])
def test_forcing_triton_without_cuda_is_a_clear_error(kw):
    model = load_tiny()
    with pytest.raises(ValueError, match="CUDA"):
        setup_backends(model, **kw)


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        setup_backends(load_tiny(), attention="flash")


def test_auto_resolves_to_concrete_names_and_a_restricted_policy():
    """One place resolves "auto": on the CPU the torch references and the CPU expert kernel,
    and the policy keeps nothing that needs Triton or CUDA."""
    wanted = KernelPolicy(fused_rope=True, triton_router=True, decode_gemv=True, shared_stream=True)
    choice = resolve_backends("cpu", policy=wanted)
    assert (choice.attention, choice.moe, choice.rms_norm, choice.linear) == (
        "torch", "cpu", "torch", "torch")  # fmt: skip
    p = choice.policy
    assert not (p.fused_rope or p.triton_router or p.decode_gemv or p.shared_stream)
    assert resolve_backends("cpu", moe="torch").moe == "torch"


def test_router_logits_float32_from_a_cached_weight_copy():
    model = load_tiny(dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    got = gate.router_logits(x)
    assert got.dtype == torch.float32
    want = F.linear(x.float(), gate.weight.float())  # transformers' computation
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cached = gate._w32
    gate.router_logits(x)
    assert gate._w32 is cached  # not re-converted per call
    gate.weight = torch.nn.Parameter(torch.randn_like(gate.weight), requires_grad=False)
    torch.testing.assert_close(gate.router_logits(x), F.linear(x.float(), gate.weight.float()))


def test_router_decode_logits_on_the_cpu_kernel():
    """A decode row's logits on the CPU come from the kernel's GEMV on its pool (no torch
    OpenMP op, no float32 weight copy): the upcast computation's values up to summation order."""
    from k2serve.kernels import cpu as ck

    model = load_tiny(dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    for T in (1, 2):
        x = torch.randn(T, 128, dtype=torch.bfloat16)
        got = gate.router_logits(x)
        assert got.dtype == torch.float32 and got.shape == (T, gate.weight.shape[0])
        want = F.linear(x.float(), gate.weight.float())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if ck.load_kernel() is not None:
        assert gate._w32 is None  # the kernel read the bf16 weight itself


def test_deferred_residual_equals_plain_residual_adds():
    model = load_tiny(dtype=torch.bfloat16)
    layer = model.model.layers[1]
    h = torch.randn(6, 128, dtype=torch.bfloat16)
    res = torch.randn(6, 128, dtype=torch.bfloat16)
    pos = torch.arange(6)
    out, new_res = layer(h, pos, residual=res)
    x = h + res  # what the previous layer's `h = h + f(h)` would have given
    x = x + layer.self_attn(layer.input_layernorm(x), pos)
    want = x + layer.mlp(layer.post_attention_layernorm(x))
    torch.testing.assert_close(out + new_res, want, rtol=0, atol=0)


def test_engine_config_flags_for_backends_placement_and_kv_dtype():
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = p.parse_args(
        "--attention-backend torch --moe-backend triton --enforce-eager --num-gpu-experts 4 "
        "--expert-placement-file counts.json --kv-cache-dtype fp8".split()
    )
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.attention_backend, cfg.moe_backend, cfg.enforce_eager) == ("torch", "triton", True)
    assert (cfg.num_gpu_experts, cfg.expert_placement_file) == (4, "counts.json")
    assert cfg.kv_cache_dtype == "fp8"
    for bad in (dict(moe_backend="cuda"), dict(num_gpu_experts=-1), dict(kv_cache_dtype="int8")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_cuda_defaults_to_triton_and_matches_the_torch_backends(fmt):
    model = load_tiny(fmt, dtype=torch.bfloat16, device="cuda")
    line = setup_backends(model)
    assert "attention=triton" in line and "moe=fused_moe" in line and "rms_norm=triton" in line
    ids = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    caches = allocate_kv_caches(model.config, 8, 16, torch.bfloat16, "cuda")
    fast = paged_logits(model, caches, ids, 16, n_prefill=20)
    setup_backends(model, "torch", "torch", "torch")
    caches = allocate_kv_caches(model.config, 8, 16, torch.bfloat16, "cuda")
    ref = paged_logits(model, caches, ids, 16, n_prefill=20)
    # bf16 activations: different kernels round differently; 3 layers stay well under 3%
    err = ((fast - ref).norm() / ref.norm()).item()
    assert err < 3e-2, err
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


# rope and router need Triton on CUDA: on the CPU restrict_policy turns them off
UNFUSED = restrict_policy(KernelPolicy(fused_rope=True, triton_router=True), "cpu")
FUSED = replace(UNFUSED, fused_projections=True)


def test_fused_projections_give_the_same_logits_and_state_dict():
    """One GEMM for q_a_proj + kv_a_proj_with_mqa and for each dense/shared MLP's gate + up (the
    CUDA default, forced here on the CPU): same logits, same state_dict, no extra copies; a
    replaced linear (as tensor-parallel sharding does) turns the fused GEMM off."""
    from k2serve.model.deepseek_v3 import MLAAttention

    model = load_tiny()
    ids = torch.randint(0, 500, (12,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)
    ref = model.compute_logits(model(ids, pos))
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.apply_kernel_policy(FUSED) == "6 gemm pairs"
    sd1 = model.state_dict()
    assert sd1.keys() == sd0.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    attn: MLAAttention = model.model.layers[1].self_attn
    assert attn.q_a_proj.weight.data_ptr() == attn.qkv_a_weight.data_ptr()  # a view, no copy
    out = model.compute_logits(model(ids, pos))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    assert model.apply_kernel_policy(UNFUSED) == ""  # CPU
    assert attn.qkv_a_weight is None and model.model.layers[0].mlp.gate_up_weight is None
    assert torch.allclose(model.compute_logits(model(ids, pos)), ref, atol=1e-5, rtol=1e-4)
    assert model.apply_kernel_policy(FUSED) == "6 gemm pairs"
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach() * 2, requires_grad=False)
    x = torch.randn(3, model.config.hidden_size)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.allclose(mlp(x), want, atol=1e-5)  # the stale fused weight is not used


def test_shared_expert_stream_is_cuda_only():
    """On the CPU, the policy's shared_stream is a no-op: no side stream, no description."""
    from k2serve.model.deepseek_v3 import MoE

    model = load_tiny()
    policy = restrict_policy(replace(UNFUSED, shared_stream=True), model.device)
    assert model.apply_kernel_policy(policy) == ""
    assert all(m.side_stream is None for m in model.modules() if isinstance(m, MoE))


@pytest.mark.gpu
@needs_cuda
def test_shared_expert_on_a_side_stream_gives_the_same_logits_eager_and_in_a_graph():
    """The shared expert on a second stream (the CUDA default): bit-identical logits to the
    in-order path, in eager mode and replayed from a CUDA graph."""
    from k2serve.model.deepseek_v3 import MoE

    model = load_tiny("int4", dtype=torch.bfloat16, device="cuda")
    assert "shared-expert stream" in setup_backends(model)
    assert any(m.side_stream is not None for m in model.modules() if isinstance(m, MoE))
    ids = torch.randint(
        0, 500, (6,), device="cuda", generator=torch.Generator("cuda").manual_seed(3)
    )
    pos = torch.arange(6, device="cuda")
    with torch.inference_mode():
        on = model.compute_logits(model(ids, pos))
        g = torch.cuda.CUDAGraph()
        model(ids, pos)  # warm-up before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            graphed = model.compute_logits(model(ids, pos))
        g.replay()
        torch.cuda.synchronize()
        model.apply_kernel_policy(replace(model.kernel_policy, shared_stream=False))  # in order
        assert all(m.side_stream is None for m in model.modules() if isinstance(m, MoE))
        off = model.compute_logits(model(ids, pos))
    assert torch.equal(on, off)
    assert torch.equal(graphed, off)
