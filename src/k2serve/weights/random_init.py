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
from typing import Any

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
    model: nn.Module,
    seed: int = 0,
    embed_scale: float | None = None,
    top_logit: float = 32.0,
    dominance: float = 16.0,
) -> torch.Tensor:
    """Make a random model's greedy next token a fixed function of the current token, decided by
    a margin far above bf16 rounding (a "peaked" dummy model, for benchmarks and exactness tests
    of speculative decoding: dummy weights' near-uniform logits otherwise flip near-ties between
    batch shapes). In place, on a loaded `DeepseekV3ForCausalLM` (single process):
    - the embedding is scaled so the residual stream stays dominated by the current token's
      embedding: its norm is `dominance` to 8 x `dominance` times the sum of every layer's
      residual contribution (the norms of the attention and MLP outputs, measured with forward
      hooks on an eager forward of 64 random tokens, repeated as the scale changes; each layer
      sees RMS-normalised input, so it still runs at full cost with its own routing).
      `embed_scale` fixes the scale instead (no calibration; K2's hidden 7168 makes the layer
      outputs several times a x64 embedding's norm, so a fixed scale is not safe);
    - lm_head row j = (top_logit / sqrt(hidden)) * unit(embedding row pred[j]), pred a random
      permutation: the logit of succ[t] is about `top_logit`, every other about
      top_logit * (N(0, 1 / sqrt(hidden)) + 1 / dominance).
    Calibrated, the forward is checked: every token's greedy next token is its successor, by a
    logit margin > top_logit / 4 (bf16 rounds a logit of 32 to 0.25); else ValueError.
    Returns succ [vocab] (int64, CPU): the token that greedily follows each token."""
    emb = model.get_parameter("model.embed_tokens.weight")  # [V, D]
    head = model.get_parameter("lm_head.weight")  # [V, D]
    if head.shape != emb.shape or head.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError("peak_logits: needs an unsharded, unquantized lm_head")
    V, D = emb.shape
    g = torch.Generator().manual_seed(seed)
    pred = torch.randperm(V, generator=g)  # [V]: token j follows token pred[j]
    succ = torch.empty_like(pred)
    succ[pred] = torch.arange(V)
    with torch.no_grad():
        for i in range(0, V, 8192):  # rows in chunks: no [V, D] float32 copy
            rows = emb[pred[i : i + 8192].to(emb.device)].float()  # [n, D]
            unit = rows / rows.norm(dim=-1, keepdim=True)
            head[i : i + 8192].copy_(unit * (top_logit / D**0.5))
        if embed_scale is not None:
            emb.mul_(embed_scale)
            setattr(model, "peak_info", {"embed_scale": embed_scale})  # noqa: B010 - nn.Module typing
            return succ
        ids = torch.randint(0, V, (64,), generator=g).to(emb.device)  # [T]
        scale, tries = 1.0, 8
        for i in range(tries):  # the layers' outputs move as their inputs do: iterate
            contrib, logits = _layer_contributions(model, ids)  # [T], [T, V]
            emb_norm = emb[ids].float().norm(dim=-1)  # [T]
            ratio = float((emb_norm / contrib).min())
            if i == tries - 1 or (scale > 1.0 and dominance <= ratio <= 8 * dominance):
                break
            # NOTE: from scale 1 this may overshoot by orders of magnitude: the random INT4
            # experts' mean (nibbles -8..7) amplifies any mean of a layer's input, and a
            # dominated stream has none; so the next pass scales down again
            step = 2 * dominance / ratio
            emb.mul_(step)
            scale *= step
        if ratio < dominance:
            raise ValueError(f"peak_logits: embedding x{scale:.3g} still only {ratio:.1f}x the "
                             f"layers' residual contributions (want {dominance:.0f}x)")  # fmt: skip
        if not torch.isfinite(emb).all() or float(emb.abs().max()) > 1e5:
            raise ValueError(f"peak_logits: embedding x{scale:.3g} leaves the bf16-safe range")
        top2 = logits.topk(2, dim=-1)  # [T, 2]: the next token after each prefix
        follows = top2.indices[:, 0].cpu() == succ[ids.cpu()]
        margin = float((top2.values[:, 0] - top2.values[:, 1]).min())
        if not bool(follows.all()) or margin < top_logit / 4:
            raise ValueError(f"peak_logits: {int(follows.sum())}/{len(ids)} calibration tokens "
                             f"followed by their successor, margin {margin:.2f}")  # fmt: skip
    # what the benchmarks print
    setattr(model, "peak_info", {"embed_scale": scale, "dominance": ratio, "margin": margin})  # noqa: B010
    return succ


def _layer_contributions(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager forward of the sequence `ids` [T] (no KV cache). -> (per token, the sum over
    layers of the norms of the attention and MLP outputs added to the residual stream [T]
    float32; the logits [T, V] float32)."""
    norms: list[torch.Tensor] = []

    def hook(_mod, _inp, out):
        norms.append(out.float().norm(dim=-1))  # [T]

    hooks = []
    for layer in model.model.layers:
        hooks += [layer.self_attn.register_forward_hook(hook),
                  layer.mlp.register_forward_hook(hook)]  # fmt: skip
    try:
        pos = torch.arange(len(ids), device=ids.device)
        logits = model.compute_logits(model(ids, pos))  # [T, V]
    finally:
        for h in hooks:
            h.remove()
    if not norms:
        return torch.full((len(ids),), 1e-6, device=ids.device), logits
    return torch.stack(norms).sum(0), logits
