"""Tiny Kimi-like and DeepSeek-like configs and checkpoints for the model tests."""

from __future__ import annotations

import pytest
import torch

from k2serve.weights.presets import preset_config

# hidden 192 = 128 + 64 gives partial FP8 column blocks; kv_a_proj has 64 + 32 = 96 rows
_COMMON = dict(
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    vocab_size=512,
    bos_token_id=256,
    eos_token_id=257,
)


def tiny_config(kind: str, fmt: str) -> dict:
    """kind: "kimi" (n_group 1, 8 experts top-2) or "deepseek" (16 experts, n_group 4,
    topk_group 2, top-4, rms_norm_eps 1e-5)."""
    cfg = preset_config("tiny", fmt)
    cfg.update(_COMMON)
    if kind == "kimi":
        cfg.update(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    elif kind == "deepseek":
        cfg.update(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            rms_norm_eps=1e-5,
            routed_scaling_factor=2.5,
        )
    else:
        raise ValueError(kind)
    return cfg


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """make_ckpt(kind, fmt) -> directory of a written checkpoint (cached per session)."""
    from k2serve.weights.make_checkpoint import make_checkpoint

    cache: dict[tuple[str, str], str] = {}

    def make(kind: str, fmt: str) -> str:
        if (kind, fmt) not in cache:
            d = tmp_path_factory.mktemp(f"{kind}-{fmt}")
            make_checkpoint(
                d,
                tiny_config(kind, fmt),
                seed=1,
                max_shard_bytes=256 << 10,
                tokenizer=False,
                progress=False,
            )
            cache[(kind, fmt)] = str(d)
        return cache[(kind, fmt)]

    return make


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: intra-op threads only add sync overhead (and spin badly on a
    busy 2-core CI machine). Restored after each test, so other packages' tests are unaffected."""

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
