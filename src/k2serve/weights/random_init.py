"""Random weights for any model in any format, generated tensor by tensor.

Used by `make-checkpoint` (CPU, written shard by shard) and by `load_format="dummy"` (straight
on the target device). Quantized weights are generated directly in their stored form (random
fp8 values / random int4 nibbles with scales), so a k2-slice is fast to make and never exists
in full precision.

Invariants:
- Yields (name, tensor) with the dtype and shape of the model parameter it fills; names are
  state_dict names (no `weight_prefix`).
- Deterministic for a given seed and device: each tensor has its own generator seeded from
  (seed, name), so the order of generation does not matter.
- Dequantized weights have std ~ 0.02 (norm weights ~ 1, router bias ~ 0.1), so logits of a
  random model are well spread and greedy decoding is stable.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from torch import nn

from k2serve.model.layers import RMSNorm
from k2serve.quant import Fp8BlockLinear, Int4GroupLinear

WEIGHT_STD = 0.02
_INT4_STD = 4.61  # std of a uniform integer in [-8, 7]


def _gen(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


_CHUNK = 1 << 24  # elements generated at a time (64 MB of float32)


def _randn(shape, g, device, std=1.0, dtype=torch.float32) -> torch.Tensor:
    """Normal(0, std) in `dtype`, generated in chunks so a [163840, 7168] embedding never
    exists in float32."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for i in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - i)
        flat[i : i + n] = torch.randn(n, generator=g, device=device) * std
    return out


def random_tensors(
    model: nn.Module, seed: int = 0, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random values for every parameter of `model` (which may live on the meta device)."""
    device = torch.device(device)
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = dict(mod.named_parameters(recurse=False))
        if not params:
            continue
        if isinstance(mod, Int4GroupLinear):
            g = _gen(seed, prefix + "weight_packed", device)
            shape = mod.weight_packed.shape
            packed = torch.randint(0, 2**32, tuple(shape), generator=g, device=device)
            packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
            if mod.in_features % 8:  # unused nibbles of the last word are zero bits
                keep_mask = (1 << (4 * (mod.in_features % 8))) - 1
                packed[:, -1] = packed[:, -1] & keep_mask
            yield prefix + "weight_packed", packed
            scale = torch.full(tuple(mod.weight_scale.shape), WEIGHT_STD / _INT4_STD)
            g = _gen(seed, prefix + "weight_scale", device)
            scale = scale.to(device) * (1 + 0.1 * _randn(scale.shape, g, device))
            yield prefix + "weight_scale", scale.to(mod.weight_scale.dtype)
            shape_t = torch.tensor([mod.out_features, mod.in_features], dtype=torch.int32)
            yield prefix + "weight_shape", shape_t.to(device)
            continue
        if isinstance(mod, Fp8BlockLinear):
            g = _gen(seed, prefix + "weight", device)
            w = _randn(mod.weight.shape, g, device, std=64.0, dtype=torch.bfloat16)
            yield prefix + "weight", w.clamp_(-448, 448).to(torch.float8_e4m3fn)
            g = _gen(seed, prefix + "weight_scale_inv", device)
            s = WEIGHT_STD / 64.0 * (1 + 0.1 * _randn(mod.weight_scale_inv.shape, g, device))
            yield prefix + "weight_scale_inv", s.to(torch.float32)
            continue
        for pname, p in params.items():
            name = prefix + pname
            g = _gen(seed, name, device)
            if isinstance(mod, RMSNorm) or (isinstance(mod, nn.LayerNorm) and pname == "weight"):
                t = 1.0 + _randn(p.shape, g, device, std=0.05)
            elif pname == "e_score_correction_bias":
                t = _randn(p.shape, g, device, std=0.1)
            else:
                t = _randn(p.shape, g, device, std=WEIGHT_STD, dtype=p.dtype)
            yield name, t.to(p.dtype)


def peak_logits(
    model: nn.Module, seed: int = 0, embed_scale: float = 64.0, top_logit: float = 32.0
) -> torch.Tensor:
    """Make a random model's greedy next token a fixed function of the current token, decided by
    a margin far above bf16 rounding (a "peaked" dummy model, for benchmarks and exactness tests
    of speculative decoding: dummy weights' near-uniform logits otherwise flip near-ties between
    batch shapes). In place, on a loaded `DeepseekV3ForCausalLM` (single process):
    - the embedding is scaled by `embed_scale`, so the residual stream stays dominated by the
      current token's embedding (each layer still sees RMS-normalised input: full cost, its own
      routing);
    - lm_head row j = (top_logit / sqrt(hidden)) * unit(embedding row pred[j]), pred a random
      permutation: the logit of succ[t] is about `top_logit`, every other about
      top_logit * N(0, 1 / sqrt(hidden)).
    Returns succ [vocab] (int64, CPU): the token that greedily follows each token."""
    emb = model.get_parameter("model.embed_tokens.weight")  # [V, D]
    head = model.get_parameter("lm_head.weight")  # [V, D]
    if head.shape != emb.shape or head.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError("peak_logits: needs an unsharded, unquantized lm_head")
    V, D = emb.shape
    g = torch.Generator().manual_seed(seed)
    pred = torch.randperm(V, generator=g)  # [V]: token j follows token pred[j]
    with torch.no_grad():
        emb.mul_(embed_scale)
        for i in range(0, V, 8192):  # rows in chunks: no [V, D] float32 copy
            rows = emb[pred[i : i + 8192].to(emb.device)].float()  # [n, D]
            unit = rows / rows.norm(dim=-1, keepdim=True)
            head[i : i + 8192].copy_(unit * (top_logit / D**0.5))
    succ = torch.empty_like(pred)
    succ[pred] = torch.arange(V)
    return succ
