import os

import pytest
import torch
from tests.conftest import tiny_hf_config


def small_config(fmt: str = "bf16", **overrides) -> dict:
    """The tiny model with 4 heads (2 per rank)."""
    return tiny_hf_config(fmt, num_attention_heads=4, num_key_value_heads=4, **overrides)


@pytest.fixture(scope="session")
def ckpts(tiny_ckpt) -> dict[str, str]:
    """fmt -> directory of a small random checkpoint (bf16, int4), no tokenizer."""
    return {
        fmt: tiny_ckpt(fmt, seed=7, tokenizer=False, num_attention_heads=4, num_key_value_heads=4)
        for fmt in ("bf16", "int4")
    }


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
