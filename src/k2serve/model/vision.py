"""K2.5 / K2.6 vision encoder: the MoonViT tower and the patch-merger projector.

Module and parameter names are the original checkpoint's (`vision_tower.patch_embed.proj`,
`vision_tower.patch_embed.pos_emb.weight`, `vision_tower.encoder.blocks.N.{norm0,norm1,wqkv,wo,
mlp.fc0,mlp.fc1}`, `vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,
proj.2}`), so the checkpoint loads without renaming (design decision 1).

The forward pass (shared/spec/kimi_format.md section 8; transformers `kimi_k25` is the oracle):
1. patch embed: Conv2d 14x14 over `pixel_values [N, 3, 14, 14]` (N patches of all images);
2. + the learned [64, 64, D] position table, bicubic-interpolated to each image's (h, w) grid;
3. pre-LN blocks: x += wo(attn(rope2d(wqkv(norm0(x))))); x += fc1(gelu_tanh(fc0(norm1(x))));
   attention is non-causal within each image only (variable length, one call per group of
   equal-length images); the 2D RoPE rotates adjacent pairs, pair j by the column (j even) or
   the row (j odd) at frequency theta^(-4 (j // 2) / head_dim);
4. final LayerNorm; 2x2 merge: [(h/2)(w/2), 4, D] (row-major within each 2x2 window);
5. projector: LayerNorm(D) per merged vector, view [.., 4D], Linear, GELU, Linear -> text width.

Invariant: `encode_images(tower, projector, pixel_values, grid_hws)` returns one
[(h/2)(w/2), text_hidden] tensor per image, in order; images never attend to each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.kernels.sdpa import sdpa
from k2serve.vision_config import VisionConfig


class PosEmb(nn.Module):
    """Learned absolute position table [H0, W0, D], resampled (bicubic) to each image's grid."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, x: torch.Tensor, grid_hws: list[tuple[int, int]]) -> torch.Tensor:
        table = self.weight  # [H0, W0, D]
        by_grid: dict[tuple[int, int], torch.Tensor] = {}  # one resampling per distinct grid
        for h, w in grid_hws:
            if (h, w) in by_grid:
                continue
            if (h, w) == tuple(table.shape[:2]):
                by_grid[h, w] = table.flatten(0, 1)
            else:
                t = F.interpolate(
                    table.permute(2, 0, 1).unsqueeze(0).float(), size=(h, w), mode="bicubic"
                )  # [1, D, h, w]
                by_grid[h, w] = t.squeeze(0).permute(1, 2, 0).flatten(0, 1).to(table.dtype)
        pos = (
            torch.cat([by_grid[g] for g in grid_hws]) if len(grid_hws) > 1 else by_grid[grid_hws[0]]
        )
        return x + pos.to(x.dtype)  # [N, D]


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        p = c.patch_size
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = PosEmb(c.pos_emb_height, c.pos_emb_width, c.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_hws: list[tuple[int, int]]):
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [N, D]
        return self.pos_emb(x, grid_hws)


def rope_2d(grid_hws: list[tuple[int, int]], head_dim: int, theta: float, device) -> torch.Tensor:
    """[N, head_dim / 2] complex64: the rotation of each patch's adjacent pairs (column on even
    pairs, row on odd ones), patches row-major per image as the preprocessor emits them."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4] / head_dim)
    parts = []
    for h, w in grid_hws:
        ys, xs = torch.meshgrid(
            torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
        )
        xf = torch.outer(xs.flatten().float(), freqs)  # [h*w, hd/4]
        yf = torch.outer(ys.flatten().float(), freqs)
        angles = torch.stack([xf, yf], dim=-1).flatten(1)  # [h*w, hd/2]: x0 y0 x1 y1 ...
        parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] rotated pairwise by freqs_cis [N, hd/2] (in float32)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [N, heads, hd/2]
    return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2).to(x.dtype)


def varlen_attention(q, k, v, seqlens: list[int]) -> torch.Tensor:
    """Non-causal attention within each segment of the flat [N, heads, hd] q/k/v; segments of
    equal length run as one batched SDPA call (flash / memory-efficient kernels on CUDA).
    Returns [N, heads, hd]."""
    if len(set(seqlens)) == 1:  # equal lengths (one image, or same-size images): no copies
        b, n = len(seqlens), seqlens[0]

        def bhnd(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, *t.shape[1:]).transpose(1, 2)  # [B, heads, n, hd]

        o = sdpa(bhnd(q), bhnd(k), bhnd(v))
        return o.transpose(1, 2).reshape(q.shape)  # [N, heads, hd]
    out = torch.empty_like(q)
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(seqlens):
        groups.setdefault(n, []).append(i)
    for n, idx in groups.items():
        segs = [slice(starts[i], starts[i] + n) for i in idx]
        qg, kg, vg = (torch.stack([t[s] for s in segs]).transpose(1, 2) for t in (q, k, v))
        o = sdpa(qg, kg, vg).transpose(1, 2)  # [B, n, heads, hd]
        for j, s in enumerate(segs):
            out[s] = o[j]
    return out


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, inter)
        self.fc1 = nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.norm0 = nn.LayerNorm(d, eps=1e-5)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.mlp = VisionMLP(d, c.intermediate_size)

    def attention(self, x: torch.Tensor, freqs_cis, seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim)  # [N, 3, heads, hd]
        q, k, v = qkv.unbind(1)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        o = varlen_attention(q, k, v.contiguous(), seqlens)  # [N, heads, hd]
        return self.wo(o.reshape(n, -1))

    def forward(self, x, freqs_cis, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), freqs_cis, seqlens)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(c.hidden_size, eps=1e-5)


class MoonViT(nn.Module):
    """Images' patches -> per-image merged features [(h/2)(w/2), 4, D]."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.encoder = VisionEncoder(c)

    def forward(
        self, pixel_values: torch.Tensor, grid_hws: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        c = self.config
        x = self.patch_embed(pixel_values, grid_hws)  # [N, D]
        freqs_cis = rope_2d(grid_hws, c.head_dim, c.rope_theta, x.device)  # [N, hd/2]
        seqlens = [h * w for h, w in grid_hws]
        for block in self.encoder.blocks:
            x = block(x, freqs_cis, seqlens)
        x = self.encoder.final_layernorm(x)
        kh, kw = c.merge_kernel_size
        out, start = [], 0
        for h, w in grid_hws:
            seq = x[start : start + h * w].view(h // kh, kh, w // kw, kw, -1)
            out.append(seq.transpose(1, 2).reshape((h // kh) * (w // kw), kh * kw, -1))
            start += h * w
        return out


class PatchMergerProjector(nn.Module):
    """`mm_projector`: [M, 4, D] -> [M, text_hidden]."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(c.hidden_size, eps=c.projector_ln_eps)
        m = c.merged_hidden_size
        self.proj = nn.Sequential(nn.Linear(m, m), nn.GELU(), nn.Linear(m, c.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(x).flatten(1))


@torch.inference_mode()
def encode_images(
    tower: MoonViT,
    projector: PatchMergerProjector,
    pixel_values: torch.Tensor,  # [N, 3, p, p] patches of all images, in order
    grid_hws: list[tuple[int, int]],
) -> list[torch.Tensor]:
    """One [tokens_i, text_hidden] embedding per image (tokens_i = h_i * w_i / 4)."""
    feats = tower(pixel_values, grid_hws)
    sizes = [f.shape[0] for f in feats]
    return list(projector(torch.cat(feats)).split(sizes))
