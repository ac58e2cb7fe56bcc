"""Test helper: a tiny transformers `Kimi_K25ForConditionalGeneration` (the numerical oracle),
saved with `save_pretrained` (so k2serve loads transformers' own names), and its greedy tokens.

Pixels for the oracle are computed here independently of k2serve: images whose sides are
multiples of 28 within every limit need no resize or padding, so their patches are exactly
(x / 255 - 0.5) / 0.5, patchified row-major over the 14 x 14 grid (shared/spec section 8).
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 512
PLACEHOLDER = VOCAB - 256 + 21  # <|media_pad|> in a k2serve tokenizer of this vocab


def tiny_config(seed: int = 0, layers: int = 2, vision_layers: int = 2):
    from transformers import Kimi_K25Config

    g = np.random.default_rng(seed)
    text = dict(
        model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=4096, tie_word_embeddings=False,
        routed_scaling_factor=float(g.choice([1.0, 2.5])),
    )  # fmt: skip
    heads = int(g.choice([2, 4]))
    # NOTE: a square table, as in every real checkpoint (64 x 64): transformers resamples the
    # table with pos_emb_height as the side of both axes, so for a non-square one it and the
    # original MoonViT (F.interpolate over (H, W), what k2serve does) disagree
    side = int(g.choice([6, 8]))
    vis = dict(
        patch_size=14, pos_emb_height=side, pos_emb_width=side,
        num_attention_heads=heads, num_hidden_layers=vision_layers, hidden_size=16 * heads,
        intermediate_size=48,
    )  # fmt: skip
    return Kimi_K25Config(
        text_config=text, vision_config=vis, projection_hidden_size=16 * heads,
        image_token_id=PLACEHOLDER, tie_word_embeddings=False,
    )  # fmt: skip


def make_reference(path, seed: int = 0, **kw):
    """Random tiny Kimi_K25ForConditionalGeneration (float32), saved to `path`; returns it."""
    from transformers import Kimi_K25ForConditionalGeneration

    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(tiny_config(seed, **kw)).eval()
    with torch.no_grad():  # non-trivial norms and biases (their init is 1 / 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "position_embeddings" in name or "embed_tokens" in name:
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def exact_pixels(rgb: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
    """[H, W, 3] uint8 with H, W multiples of 28 -> ([h*w, 3, 14, 14], (h, w))."""
    h, w = rgb.shape[0] // 14, rgb.shape[1] // 14
    x = (rgb.astype(np.float32) / 255.0 - 0.5) / 0.5  # [H, W, 3]
    x = x.reshape(h, 14, w, 14, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, 14, 14)
    return torch.from_numpy(np.ascontiguousarray(x)), (h, w)


def expand(prompt: list[int], grids: list[tuple[int, int]]) -> list[int]:
    """The prompt with the k-th placeholder repeated h*w/4 times for image k."""
    out, k = [], 0
    for t in prompt:
        if t == PLACEHOLDER:
            h, w = grids[k]
            out.extend([PLACEHOLDER] * (h * w // 4))
            k += 1
        else:
            out.append(t)
    return out


@torch.inference_mode()
def greedy(model, prompt: list[int], images: list[np.ndarray], steps: int) -> list[int]:
    """Greedy tokens by full recomputation each step (no cache)."""
    pix = [exact_pixels(im) for im in images]
    grids = [g for _, g in pix]
    ids = expand(prompt, grids)
    kw = {}
    if images:
        kw = dict(
            pixel_values=torch.cat([p for p, _ in pix]),
            image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]),
        )
    out = []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), **kw).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
    return out


def random_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
