import os

import pytest
import torch

# the tiny preset made smaller (CI time), still with every kind of layer: 1 dense + 2 MoE
# layers, 8 experts top-2, 4 heads (2 per rank), 1 shared expert
SMALL = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
)


def small_config(fmt: str = "bf16", **overrides) -> dict:
    from k2serve.weights.presets import preset_config

    cfg = preset_config("tiny", fmt)
    cfg.update(SMALL)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """fmt -> directory of a small random checkpoint (bf16, int4), no tokenizer."""
    from k2serve.weights.make_checkpoint import make_checkpoint

    out = {}
    for fmt in ("bf16", "int4"):
        d = tmp_path_factory.mktemp(f"tp-{fmt}")
        make_checkpoint(d, small_config(fmt), seed=7, progress=False, tokenizer=False)
        out[fmt] = str(d)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread here and in spawned workers (2-core CI box)."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
