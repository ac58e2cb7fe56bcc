"""Tiny Kimi-like and DeepSeek-like configs and checkpoints for the model tests."""

from __future__ import annotations

import pytest
from tests.conftest import SMALL_VOCAB, tiny_hf_config

# hidden 192 = 128 + 64 gives partial FP8 column blocks; kv_a_proj has 64 + 32 = 96 rows
_COMMON = dict(hidden_size=192, q_lora_rank=96, **SMALL_VOCAB)
_KINDS = {
    "kimi": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1),
    "deepseek": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                     rms_norm_eps=1e-5, routed_scaling_factor=2.5),
}  # fmt: skip


def tiny_config(kind: str, fmt: str) -> dict:
    """kind: "kimi" (n_group 1, 8 experts top-2) or "deepseek" (16 experts, n_group 4,
    topk_group 2, top-4, rms_norm_eps 1e-5)."""
    if kind not in _KINDS:
        raise ValueError(kind)
    return tiny_hf_config(fmt, **_COMMON, **_KINDS[kind])


@pytest.fixture(scope="session")
def make_ckpt(tiny_ckpt):
    """make_ckpt(kind, fmt) -> directory of a written checkpoint (cached per session)."""

    def make(kind: str, fmt: str) -> str:
        if kind not in _KINDS:
            raise ValueError(kind)
        return tiny_ckpt(fmt, seed=1, tokenizer=False, max_shard_bytes=256 << 10,
                         **_COMMON, **_KINDS[kind])  # fmt: skip

    return make
