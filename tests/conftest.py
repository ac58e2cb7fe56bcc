"""Fixtures shared by every test package: the tiny model every CPU test builds, and one
intra-op thread.

`tiny_hf_config(fmt, **changes)` is the one tiny DeepSeek-V3 / Kimi-K2 config (the "tiny"
preset at CI size: 3 layers, 1 dense + 2 MoE, 8 experts top-2, 1 shared expert, sizes multiples
of 32 for the INT4 groups); a package states only what it changes (fewer layers, more heads,
partial FP8 blocks). `tiny_ckpt(fmt, **changes)` writes it as a checkpoint once per session.
Import the function with `from tests.conftest import tiny_hf_config` (pytest runs from the
repository root, as `tests.model.conftest` is imported elsewhere).
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (tests/kernels, tests/moe).
# Set here, before any test module is imported: `triton.jit` and kernels._triton read it at
# import, and a test package collected before tests/kernels (engine/test_warmup.py imports the
# MoE backends) would otherwise freeze them in the compiled mode for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
)
# the preset's vocabulary (2048) goes with its tokenizer files; model-only tests take 512
SMALL_VOCAB = dict(vocab_size=512, bos_token_id=256, eos_token_id=257)


def tiny_hf_config(fmt: str = "bf16", **changes) -> dict:
    """The tiny model's config.json (a dict) in weight format `fmt`, with `changes`."""
    from k2serve.weights.presets import preset_config

    cfg = preset_config("tiny", fmt)
    cfg.update(TINY)
    cfg.update(changes)
    return cfg


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(fmt="bf16", *, seed=1, tokenizer=True, max_shard_bytes=None, **changes) ->
    the directory of that checkpoint, written once per session."""
    from k2serve.weights.make_checkpoint import make_checkpoint

    cache: dict[tuple, str] = {}

    def make(fmt="bf16", *, seed=1, tokenizer=True, max_shard_bytes=None, **changes) -> str:
        key = (fmt, seed, tokenizer, max_shard_bytes, tuple(sorted(changes.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{fmt}")
            shards = {} if max_shard_bytes is None else dict(max_shard_bytes=max_shard_bytes)
            make_checkpoint(d, tiny_hf_config(fmt, **changes), seed=seed, tokenizer=tokenizer,
                            progress=False, **shards)  # fmt: skip
            cache[key] = str(d)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: intra-op threads only add sync overhead (and spin badly on a
    busy 2-core CI machine). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
