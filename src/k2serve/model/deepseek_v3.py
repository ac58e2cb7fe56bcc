"""The DeepSeek-V3 / Kimi-K2 text model in PyTorch, with the checkpoint's module names.

Over 500 lines on purpose: the whole forward of the one architecture k2serve serves (MLA in its
naive and absorbed forms, the MoE block with its host round trip, the layers) reads top to bottom
in one file, as the DeepSeek reference and HF's modeling file do; the backends it calls live
elsewhere (attention/, moe/, quant/; chosen in model/backends.py).

Owns: MLA attention (naive form without a cache; absorbed form over the paged latent cache),
dense MLP, MoE block (router + routed experts via an ExpertBackend + shared experts), decoder
layers, the model and the untied lm_head.

Invariants:
- Module names equal the Hugging Face checkpoint's (without the K2.5 `language_model.`
  prefix), so `state_dict()` keys are checkpoint tensor names.
- Activations are flat: [T, hidden]. With `attn_metadata=None` the T tokens are ONE sequence
  with causal attention and no cache (naive MLA, as transformers computes it).
- With `attn_metadata`, each layer stores the normed latent + roped k_pe of the new tokens in
  its cache, folds kv_b_proj into the query (W_UK) and the output (W_UV), and calls the
  attention backend (absorbed MLA).
- `DeepseekV3ForCausalLM.pieces` is the forward as a generator that yields each hybrid MoE
  layer's host actions (the CPU experts' round trip, moe.host_round_trip.HostJob) between stretches
  of device work, for piecewise CUDA graphs (model.cuda_graph); `forward` is plain module calls.
- q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever rms_norm_eps is. NOTE: this is what
  transformers and DeepSeek's reference code do (they build these norms without eps); vLLM
  passes rms_norm_eps instead, which differs for K2.5 (1e-5).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.attention.torch_ref import TorchMLABackend
from k2serve.config import ModelConfig
from k2serve.kernels.cpu import cpu_head_gemv
from k2serve.kernels.cpu.logits import cpu_float32
from k2serve.kernels.policy import KernelPolicy
from k2serve.model.layers import RMSNorm, YarnRotaryEmbedding
from k2serve.model.router import TopkRouter
from k2serve.model.vision import MoonViT, PatchMergerProjector, encode_images
from k2serve.moe import ExpertBackend, TorchExpertBackend
from k2serve.moe.cpu_shared import CpuSharedExpert
from k2serve.moe.host_round_trip import drive
from k2serve.moe.placement import ExpertPlacement
from k2serve.quant import LinearBase, linear_scheme, make_linear
from k2serve.quant.linear import Fp8BlockLinear, linear

logger = logging.getLogger(__name__)

# name (as in the checkpoint, prefix included) -> scheme ("bf16", "fp8_block", "int4_group")
SchemeFn = Callable[[str], str]


class _Builder:
    """Makes linears with the right scheme for their checkpoint name."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, scheme_fn: SchemeFn) -> None:
        self.config = config
        self.dtype = dtype
        self.scheme_fn = scheme_fn

    def linear(self, name: str, in_features: int, out_features: int) -> LinearBase:
        scheme = self.scheme_fn(self.config.weight_prefix + name)
        return make_linear(in_features, out_features, scheme, self.dtype, self.config.quant)


def _fuse_rows(*linears: LinearBase) -> torch.Tensor | None:
    """One [sum(out), in] weight for bf16/fp16/fp32 linears that read the same input; each
    linear's `weight` is re-pointed to its rows (a view: no extra memory, state_dict unchanged).
    None when any linear is quantized or they differ in dtype/device."""
    from k2serve.quant.linear import UnquantizedLinear

    if not all(type(m) is UnquantizedLinear for m in linears):
        return None
    ws = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    fused = torch.cat([w.detach() for w in ws], 0)
    r0 = 0
    for m, w in zip(linears, ws, strict=True):
        m.weight = nn.Parameter(fused[r0 : r0 + w.shape[0]], requires_grad=False)
        r0 += w.shape[0]
    return fused


def _still_fused(fused: torch.Tensor | None, *linears: LinearBase) -> bool:
    """True while each linear's weight is still its rows of `fused` (not after a module or a
    parameter was replaced, e.g. by tensor-parallel sharding)."""
    if fused is None:
        return False
    ptr, step = fused.data_ptr(), fused.element_size() * fused.shape[1]
    for m in linears:
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.data_ptr() != ptr:
            return False
        ptr += step * w.shape[0]
    return True


class MLP(nn.Module):
    def __init__(self, b: _Builder, prefix: str, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = b.linear(f"{prefix}.gate_proj", hidden, inter)
        self.up_proj = b.linear(f"{prefix}.up_proj", hidden, inter)
        self.down_proj = b.linear(f"{prefix}.down_proj", inter, hidden)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_projections (one GEMM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _still_fused(self.gate_up_weight, self.gate_proj, self.up_proj):
            table = self.gate_proj.gemv_table
            if table is not None:  # one row on CUDA: the GEMV with SiLU * up fused
                from k2serve.kernels.gemv import gemv_silu_mul, use_gemv

                if use_gemv(x, self.gate_up_weight, table):
                    return self.down_proj(gemv_silu_mul(x, self.gate_up_weight, table))
            # NOTE: the width comes from the linears, not the config: TP shards them (on CUDA
            # the one-row GEMV case is handled above, so this is the GEMM; on the CPU linear()
            # is the CPU kernel's GEMV at decode: one call for gate and up)
            n = self.gate_proj.out_features
            g, u = linear(x, self.gate_up_weight).split([n, n], dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_projections(self) -> bool:
        if not _still_fused(self.gate_up_weight, self.gate_proj, self.up_proj):
            self.gate_up_weight = _fuse_rows(self.gate_proj, self.up_proj)
        return self.gate_up_weight is not None


class MoE(nn.Module):
    def __init__(self, b: _Builder, prefix: str) -> None:
        super().__init__()
        c = b.config
        self.gate = TopkRouter(c, b.dtype)
        self.experts = nn.ModuleList(
            MLP(b, f"{prefix}.experts.{e}", c.hidden_size, c.moe_intermediate_size)
            for e in range(c.n_routed_experts)
        )
        self.shared_experts = (
            MLP(
                b,
                f"{prefix}.shared_experts",
                c.hidden_size,
                c.moe_intermediate_size * c.n_shared_experts,
            )
            if c.n_shared_experts
            else None
        )
        self.expert_backend: ExpertBackend = TorchExpertBackend(self.experts)
        # CPU decode on many threads: the shared expert as one CPU experts-kernel call
        self.cpu_shared = CpuSharedExpert()
        # CUDA: a second stream on which the shared expert runs while the router and the
        # routed experts run on the current one, for steps of up to side_stream_max_tokens
        # tokens (decode is memory-bound, so the two overlap; above, two compute-bound GEMMs
        # contend). Set by the kernel policy; None: in order.
        self.side_stream: torch.cuda.Stream | None = None
        # routing counts [E] int64 on the device and the valid-row mask [max_tokens] int64
        # (graph padding rows 0), set by moe.placement.RoutingRecorder; None: not recording
        self.routing_counts: torch.Tensor | None = None
        self.routing_valid: torch.Tensor | None = None
        self.side_stream_max_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if getattr(self.expert_backend, "pieces", None) is None:  # no host round trip
            if x.device.type == "cpu" and self.shared_experts is not None:
                return self._cpu_routed_plus_shared(x)
            return self.routed_plus_shared(x, self.routed)
        return drive(self.pieces(x))

    def _cpu_routed_plus_shared(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """On the CPU: the routed experts and the shared expert in one CPU kernel call where
        moe.cpu_shared runs the shared expert on the kernel and the routed experts are on it
        too (CpuSharedExpert.with_routed), else routed(x) + shared(x)."""
        if type(self).routed is not MoE.routed:  # a subclass's own routing
            return self.routed_plus_shared(x, self.routed)
        topk_weights, topk_ids = self.gate(x)  # [T, k] float32, [T, k] int64
        self._record_routing(topk_ids)
        be, mlp = self.expert_backend, self.shared_experts
        y = self.cpu_shared.with_routed(mlp, be, x, topk_ids, topk_weights)
        return be(x, topk_ids, topk_weights) + self.shared(x) if y is None else y

    def pieces(self, x: torch.Tensor):
        """Generator of the block's output. With a hybrid backend the CPU experts' host round
        trip is yielded as host actions around the GPU part (GPU experts + shared expert, so
        both run while the CPU computes; see moe.host_round_trip.HostJob); otherwise no yield."""
        if type(self).forward is not MoE.forward:  # a subclass's own forward (tensor parallel)
            return self(x)
        be = self.expert_backend
        be_pieces = getattr(be, "pieces", None)
        if be_pieces is None:
            return self.routed_plus_shared(x, self.routed)
        topk_weights, topk_ids = self.gate(x)  # [T, k] float32, [T, k] int64
        self._record_routing(topk_ids)

        def gpu(y):
            return self.routed_plus_shared(y, lambda z: be.gpu_part(z, topk_ids, topk_weights))

        return (yield from be_pieces(x, topk_ids, topk_weights, gpu=gpu))

    def _record_routing(self, topk_ids: torch.Tensor) -> None:
        """Add this step's (token, expert) pairs to `routing_counts` (set by
        moe.placement.RoutingRecorder) on the device, no host sync: inside CUDA graphs too.
        Rows where `routing_valid` is 0 (a graph's padding) are not counted."""
        counts = self.routing_counts
        if counts is None:
            return
        T, k = topk_ids.shape
        valid = self.routing_valid
        if valid is not None and valid.shape[0] >= T:
            add = valid[:T, None].expand(T, k).reshape(-1)  # [T * k]
        else:
            add = torch.ones(T * k, dtype=counts.dtype, device=counts.device)
        counts.index_add_(0, topk_ids.reshape(-1), add.to(counts.dtype))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, k] float32, [T, k] int64
        self._record_routing(topk_ids)
        return self.expert_backend(x, topk_ids, topk_weights)

    def take_shared_expert(self, moe: MoE) -> None:
        """Use `moe`'s shared expert and how it runs (the CPU decode path, the CUDA side
        stream): for the parallel MoE blocks, which are built from a MoE without its
        __init__."""
        self.shared_experts = moe.shared_experts
        self.cpu_shared = moe.cpu_shared
        self.side_stream = moe.side_stream
        self.side_stream_max_tokens = moe.side_stream_max_tokens

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert: at CPU decode from moe.cpu_shared.KERNEL_MIN_THREADS pool threads
        one call of the CPU experts kernel (faster there, measured), else the module."""
        mlp = self.shared_experts
        assert mlp is not None
        y = self.cpu_shared(mlp, x) if x.device.type == "cpu" else None
        return mlp(x) if y is None else y

    def routed_plus_shared(self, x: torch.Tensor, routed) -> torch.Tensor:
        """routed(x) + shared_experts(x). With a side stream (CUDA) the shared expert is
        enqueued there first and joined before the sum: the two are independent, and the
        routed GEMVs leave DRAM bandwidth and SMs idle at small batch. Safe in CUDA graphs
        (fork/join by stream waits); tensors cross streams only before the fork (x, made on
        the current stream) or after the join (the shared output)."""
        if self.shared_experts is None:
            return routed(x)
        side = self.side_stream
        if side is None or not x.is_cuda or x.shape[0] > self.side_stream_max_tokens:
            return routed(x) + self.shared(x)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = self.shared_experts(x)
        out = routed(x)
        main.wait_stream(side)
        return out + shared


def _host_round_trip(mlp: nn.Module) -> bool:
    """True for a MoE block whose experts need the host mid-layer (a hybrid GPU + CPU layer
    run by MoE.forward itself, not by a tensor-parallel subclass)."""
    be = getattr(mlp, "expert_backend", None)
    return (getattr(be, "pieces", None) is not None and isinstance(mlp, MoE)
            and type(mlp).forward is MoE.forward)  # fmt: skip


def _run_forward_hooks(module: nn.Module, args: tuple, out):
    """What `module(*args)` does with `out` after forward: its forward hooks, in order (a hook
    that returns a value replaces the output)."""
    for hook_id, hook in module._forward_hooks.items():
        if hook_id in module._forward_hooks_with_kwargs:
            r = hook(module, args, {}, out)
        else:
            r = hook(module, args, out)
        if r is not None:
            out = r
    return out


class MLAAttention(nn.Module):
    def __init__(self, b: _Builder, prefix: str, rope: YarnRotaryEmbedding) -> None:
        super().__init__()
        c = b.config
        self.num_heads = H = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_head_dim
        self.v_head_dim = c.v_head_dim
        self.scaling = c.softmax_scale
        self.rope = rope
        D = c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = b.linear(f"{prefix}.q_proj", D, H * c.qk_head_dim)
        else:
            self.q_a_proj = b.linear(f"{prefix}.q_a_proj", D, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6, b.dtype)
            self.q_b_proj = b.linear(f"{prefix}.q_b_proj", c.q_lora_rank, H * c.qk_head_dim)
        self.kv_a_proj_with_mqa = b.linear(
            f"{prefix}.kv_a_proj_with_mqa", D, c.kv_lora_rank + c.qk_rope_head_dim
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6, b.dtype)
        self.kv_b_proj = b.linear(
            f"{prefix}.kv_b_proj", c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)
        )
        self.o_proj = b.linear(f"{prefix}.o_proj", H * c.v_head_dim, D)
        self.backend: MLABackend = TorchMLABackend()
        self.fused_rope = False  # kernel policy: one Triton launch for q_pe and k_pe
        self.fused_absorb = False  # kernel policy (decode_gemv): Triton W_UK / W_UV products
        self.qkv_a_weight: torch.Tensor | None = None  # set by fuse_projections (one GEMM)

    def fuse_projections(self) -> bool:
        """q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM (bf16 weights)."""
        if self.q_lora_rank is not None and not self._qkv_a_fused():
            self.qkv_a_weight = _fuse_rows(self.q_a_proj, self.kv_a_proj_with_mqa)
        return self.qkv_a_weight is not None

    def _qkv_a_fused(self) -> bool:
        return self.q_lora_rank is not None and _still_fused(
            self.qkv_a_weight, self.q_a_proj, self.kv_a_proj_with_mqa
        )

    def _qkv_latent(self, x: torch.Tensor, positions: torch.Tensor):
        T = x.shape[0]
        if self._qkv_a_fused():
            q_a, ckv = linear(x, self.qkv_a_weight, self.q_a_proj.gemv_table).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            if self.q_lora_rank is None:
                q = self.q_proj(x)
            else:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            ckv = self.kv_a_proj_with_mqa(x)  # [T, L + R]
        q = q.view(T, self.num_heads, self.qk_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = ckv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, L]
        cos, sin = self.rope.cos_sin(positions)  # [T, R / 2]
        if self.fused_rope and q_pe.is_cuda:
            from k2serve.kernels.rope import rope_qk

            q_pe, k_pe = rope_qk(q_pe, k_pe, cos, sin)  # same roundings as the torch code
        else:
            q_pe = self.rope.apply(q_pe, cos, sin)  # [T, H, R]
            k_pe = self.rope.apply(k_pe, cos, sin)  # [T, R]
        return q_nope, q_pe, latent, k_pe

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        attn_metadata: AttentionMetadata | None = None,
        kv_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe = self._qkv_latent(x, positions)
        if attn_metadata is None:
            o = self._naive(q_nope, q_pe, latent, k_pe)
        else:
            o = self._absorbed(q_nope, q_pe, latent, k_pe, attn_metadata, kv_cache)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.v_head_dim))

    def _naive(self, q_nope, q_pe, latent, k_pe) -> torch.Tensor:
        """One causal sequence: expand the latent to per-head keys/values. -> [T, H, v]."""
        T, H = q_nope.shape[0], self.num_heads
        kv = self.kv_b_proj(latent).view(T, H, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, T, qk]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, -1)], dim=-1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scaling  # [H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v.transpose(0, 1)).transpose(0, 1)  # [T, H, v]

    def _absorbed(self, q_nope, q_pe, latent, k_pe, md, kv_cache) -> torch.Tensor:
        """Paged latent cache: fold kv_b_proj into the query and the output. -> [T, H, v]."""
        if kv_cache is None:
            raise ValueError("attn_metadata is given but the layer has no kv_cache")
        if getattr(self.backend, "prefill", None) == "expand" and md.max_query_len > 1:
            # prompts in the non-absorbed form (kv_b_proj + flash attention: ~3x fewer FLOPs
            # at long prompts); a mixed step's decodes stay absorbed (vLLM's MLA split)
            from k2serve.attention.triton_mla import mla_prefill_expanded

            d = md.num_decodes
            if d == 0:
                return mla_prefill_expanded(self, q_nope, q_pe, latent, k_pe, md, kv_cache)
            dec, rest = md.split_decodes()
            o_dec = self._absorbed(q_nope[:d], q_pe[:d], latent[:d], k_pe[:d], dec, kv_cache)
            o_rest = mla_prefill_expanded(
                self, q_nope[d:], q_pe[d:], latent[d:], k_pe[d:], rest, kv_cache
            )
            return torch.cat([o_dec, o_rest])  # [T, H, V]
        H, N, V = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        w = self.kv_b_proj.dequantized_weight(q_nope.dtype).view(H, N + V, self.kv_lora_rank)
        w_uk, w_uv = w[:, :N, :], w[:, N:, :]  # [H, N, L], [H, V, L]
        self.backend.store(kv_cache, latent, k_pe, md.slot_mapping)
        fused = False
        if self.fused_absorb and q_nope.is_cuda:  # few tokens: one Triton launch per product
            from k2serve.kernels import mla_absorb

            fused = mla_absorb.usable(q_nope, w)
        if fused:
            q_latent = mla_absorb.absorb_q(q_nope, w)
        elif not q_nope.is_cuda:  # CPU: per-head GEMVs / GEMMs on weights laid out once
            w_uk_t, w_uv = self._cpu_absorb_weights(w)
            q_latent = cpu_head_gemv(q_nope, w_uk_t)  # decode: the kernel's GEMV, else None
            if q_latent is None:
                q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk_t.transpose(1, 2))
                q_latent = q_latent.transpose(0, 1).contiguous()  # [T, H, L]
        else:
            q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, L]
        o_latent = self.backend.forward(q_latent, q_pe, kv_cache, md, self.scaling)  # [T, H, L]
        if fused and o_latent.stride(-1) == 1:
            return mla_absorb.absorb_o(o_latent, w, N)
        if not o_latent.is_cuda:
            o = cpu_head_gemv(o_latent, w_uv)
            if o is None:
                o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
            return o  # [T, H, V]
        return torch.einsum("thl,hvl->thv", o_latent, w_uv)  # [T, H, V]

    def _cpu_absorb_weights(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK^T [H, L, N], W_UV [H, V, L]) contiguous (rows of the per-head GEMVs the CPU
        kernel reads; bmm takes their transposed views), made once per kv_b_proj weight and
        dtype. NOTE: on the CPU, einsum copied the strided W_UV view into a transposed layout on
        every call (2.3 ms per layer at batch 1 on a 2-core dev machine, 0.17 ms as one bmm on
        the laid-out weight); the copy costs 2 x 8 MiB per layer of host memory."""
        key = (tuple(p.data_ptr() for p in self.kv_b_proj.parameters()), w.dtype)
        cached = getattr(self, "_cpu_absorb", None)
        if cached is None or cached[0] != key:
            N = self.qk_nope_head_dim
            cached = (key, w[:, :N, :].transpose(1, 2).contiguous(), w[:, N:, :].contiguous())
            self._cpu_absorb = cached
        return cached[1], cached[2]


class DecoderLayer(nn.Module):
    def __init__(self, b: _Builder, idx: int, rope: YarnRotaryEmbedding) -> None:
        super().__init__()
        c = b.config
        self.layer_idx = idx
        prefix = f"model.layers.{idx}"
        self.self_attn = MLAAttention(b, f"{prefix}.self_attn", rope)
        if c.is_moe_layer(idx):
            self.mlp: nn.Module = MoE(b, f"{prefix}.mlp")
            self.mlp.gate.layer_idx = idx  # named in the router's non-finite input warning
        else:
            self.mlp = MLP(b, f"{prefix}.mlp", c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype)

    def forward(self, h, positions, attn_metadata=None, kv_cache=None, residual=None):
        """-> (h, residual): the layer's output is h + residual (vLLM's deferred residual add,
        so the add fuses into the next RMSNorm). residual=None at the first layer."""
        x, residual = self._attention(h, positions, attn_metadata, kv_cache, residual)
        return self.mlp(x), residual

    def pieces(self, h, positions, attn_metadata=None, kv_cache=None, residual=None):
        """Generator form of forward for a hybrid MoE layer: yields the MoE block's host
        actions (see MoE.pieces); the block's forward hooks are run by hand."""
        x, residual = self._attention(h, positions, attn_metadata, kv_cache, residual)
        out = yield from self.mlp.pieces(x)
        return _run_forward_hooks(self.mlp, (x,), out), residual

    def _attention(self, h, positions, attn_metadata, kv_cache, residual):
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.self_attn(x, positions, attn_metadata, kv_cache)
        return self.post_attention_layernorm.add_norm(h, residual)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DeepseekV3Model(nn.Module):
    def __init__(self, b: _Builder) -> None:
        super().__init__()
        c = b.config
        rope = YarnRotaryEmbedding(
            c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, b.dtype)
        self.layers = nn.ModuleList(DecoderLayer(b, i, rope) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype)
        self.rope = rope  # shared by every layer (not a module: no state)


class DeepseekV3ForCausalLM(nn.Module):
    """The text model. `state_dict()` keys are the checkpoint names minus `weight_prefix`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        scheme_fn: SchemeFn | None = None,
    ) -> None:
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=true is not supported (Kimi's lm_head is untied)")
        self.config = config
        self.dtype = dtype
        fn = scheme_fn or (lambda name: linear_scheme(name, config.quant))
        b = _Builder(config, dtype, fn)
        self.model = DeepseekV3Model(b)
        self.lm_head = b.linear("lm_head", config.hidden_size, config.vocab_size)
        if config.vision is not None:  # K2.5: the image encoder beside the text model
            self.vision_tower = MoonViT(config.vision).to(dtype)
            self.mm_projector = PatchMergerProjector(config.vision).to(dtype)
        self.expert_placement: ExpertPlacement | None = None  # None = all on self.device
        self.routing_recorder = None  # moe.placement.RoutingRecorder while recording
        # EAGLE-3 drafting: target layers whose input hidden state each forward keeps, and the
        # last forward's [T, 3 * hidden] concat of them (engine.spec_decode.eagle)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        self.kernel_policy = KernelPolicy.reference()  # set by install_backends

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def set_attn_backend(self, backend: MLABackend) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def moe_blocks(self) -> list[MoE]:
        return [ly.mlp for ly in self.model.layers if isinstance(ly.mlp, MoE)]

    def install_backends(
        self,
        attention: MLABackend,
        experts: Callable[[int, nn.ModuleList], ExpertBackend],
        triton_norm: bool,
        policy: KernelPolicy,
        placement: ExpertPlacement | None = None,
    ) -> str:
        """Wire concrete backends in (chosen by `k2serve.model.backends`): `attention` for every
        layer, `experts(layer_idx, experts)` for each MoE layer's routed experts, the Triton
        RMSNorm on or off, the kernel `policy` (`apply_kernel_policy`) and the expert
        `placement` they were built for (None: every expert on the model's device). Returns
        what `apply_kernel_policy` returns."""
        self.set_attn_backend(attention)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.use_triton = triton_norm
        fused = self.apply_kernel_policy(policy)
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.expert_backend = experts(layer.layer_idx, layer.mlp.experts)
        self.expert_placement = placement
        return fused

    def apply_kernel_policy(self, p: KernelPolicy) -> str:
        """Hand each layer its part of the policy `p` (restricted to what the device runs by
        `model.backends.restrict_policy`): the Triton RoPE for q_pe + k_pe, the Triton router
        top-k, one GEMM for q_a_proj + kv_a_proj_with_mqa and for each dense/shared MLP's
        gate + up (bf16 weights; re-pointed as views of the fused weight, so memory and
        state_dict are unchanged; off goes back to one GEMM each), the one-row GEMV for the bf16
        projections and the router at batch 1 with the policy's tuned configs, the shared
        expert on a second stream, and the FP8 GEMM kernel with its tuned configs. Returns a
        short description of what is on."""
        tables = p.tables
        side = torch.cuda.Stream(device=self.device) if p.shared_stream else None  # not in a
        for m in self.modules():  # capture: made here, at setup
            if isinstance(m, MoE):
                m.side_stream = side
                m.side_stream_max_tokens = tables.side_stream_max_tokens
            if isinstance(m, (LinearBase, TopkRouter)):
                m.gemv_table = tables.gemv_bf16 if p.decode_gemv else None
            if isinstance(m, Fp8BlockLinear):
                m.kernel_tables = tables if p.fp8_gemm else None
        fused_proj = 0
        for layer in self.model.layers:
            layer.self_attn.fused_rope = p.fused_rope
            layer.self_attn.fused_absorb = p.decode_gemv
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                mlp.gate.use_triton = p.triton_router
            m = mlp.shared_experts if isinstance(mlp, MoE) else mlp
            if p.fused_projections:
                fused_proj += int(layer.self_attn.fuse_projections())
                if m is not None:
                    fused_proj += int(m.fuse_projections())
            else:  # separate GEMMs again (the linears keep their weights: views, same values)
                layer.self_attn.qkv_a_weight = None
                if m is not None:
                    m.gate_up_weight = None
        self.kernel_policy = p
        on = [d for d in (p.describe(), f"{fused_proj} gemm pairs" if fused_proj else "") if d]
        return "+".join(on)

    @property
    def decode_graph_safe(self) -> bool:
        """True when every layer's attention backend can be captured in a CUDA graph (the torch
        reference backend cannot: it syncs with the host; Triton can, fp8 caches included)."""
        return all(layer.self_attn.backend.graph_safe for layer in self.model.layers)

    @property
    def has_cpu_experts(self) -> bool:
        p = self.expert_placement
        return p is not None and not p.all_on_gpu

    def encode_images(
        self, pixel_values: torch.Tensor, grid_hws: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """K2.5: patches [N, 3, p, p] of images with patch grids `grid_hws` -> one
        [h*w/4, hidden] embedding per image (model.vision)."""
        if self.config.vision is None:
            raise ValueError("this model has no vision tower (config.json has no vision_config)")
        pv = pixel_values.to(self.device, self.vision_tower.patch_embed.proj.weight.dtype)
        return encode_images(self.vision_tower, self.mm_projector, pv, grid_hws)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        attn_metadata: AttentionMetadata | None = None,
        kv_caches: list[torch.Tensor] | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`mm_embeds`: (rows [M] long, embeddings [M, hidden]) that replace the token
        embeddings at those rows of the flat batch (image placeholder positions)."""
        # split=False: every layer is a module call (a hybrid MoE block runs its own host
        # round trip inline), so nothing is yielded
        return drive(self.pieces(input_ids, positions, attn_metadata, kv_caches, False, mm_embeds))

    def pieces(
        self, input_ids, positions, attn_metadata=None, kv_caches=None, split=True, mm_embeds=None
    ):
        """Generator form of forward: the GPU work between two yields is one piece, each
        yielded host action (a hybrid layer's CPU round trip) runs between pieces; without CPU
        experts nothing is yielded. model.cuda_graph.DecodeGraphRunner captures the pieces
        as CUDA graphs. NOTE: a split hybrid layer runs its forward hooks by hand (forward
        pre-hooks and global hooks are not run there)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                "must be the same 1-D shape [T]"
            )
        layers = self.model.layers
        if attn_metadata is not None and (kv_caches is None or len(kv_caches) != len(layers)):
            raise ValueError(
                f"attn_metadata needs kv_caches with one tensor per layer ({len(layers)})"
            )
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if mm_embeds is not None:
            rows, emb = mm_embeds
            h = h.index_copy(0, rows, emb.to(h.dtype))
        residual = None
        aux_ids = self.aux_hidden_state_layers  # EAGLE-3: the residual stream entering them
        aux: dict[int, torch.Tensor] = {}
        self.model.rope.step_cache(True)  # cos/sin once per step, not once per layer
        try:
            for i, layer in enumerate(layers):
                if aux_ids and i in aux_ids:
                    aux[i] = h if residual is None else h + residual  # [T, hidden]
                cache = kv_caches[i] if kv_caches else None
                args = (h, positions, attn_metadata, cache, residual)
                if split and _host_round_trip(layer.mlp):
                    out = yield from layer.pieces(*args)
                    h, residual = _run_forward_hooks(layer, args, out)
                else:
                    h, residual = layer(*args)
        finally:
            self.model.rope.step_cache(False)
        if aux_ids:
            # [T, len(aux_ids) * hidden], in the draft's order
            self.aux_hidden_states = torch.cat([aux[i] for i in aux_ids], dim=-1)
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm.add_norm(h, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, vocab] float32
        # CPU decode: widened on the calling thread (torch's .to() woke its OpenMP team)
        return cpu_float32(self.lm_head(hidden))
