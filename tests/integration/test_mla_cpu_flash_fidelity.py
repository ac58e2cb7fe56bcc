"""The CPU flash path of the torch attention backend (bf16 model, bf16 cache) through the
fidelity harness: every layer within the rounding budget that the float32-einsum reference in
bf16 sets against the float32 gold pass, for decodes, a batch of decodes and a prompt over a
cached prefix (routing pinned)."""

from __future__ import annotations

import pytest
import torch

from k2serve.attention import cpu_flash
from k2serve.attention.torch_ref import TorchMLABackend
from k2serve.model.backends import setup_backends
from k2serve.testing.fidelity import (
    Variant,
    check_model,
    decode_batch,
    prefix_prefill_batch,
    reference_setup,
)

from .conftest import load_tiny

pytestmark = pytest.mark.skipif(not cpu_flash.available(), reason="no CPU flash kernel")


def test_cpu_flash_attention_within_the_bf16_budget():
    model = load_tiny("bf16", dtype=torch.bfloat16)
    calls = []

    def flash(m):
        setup_backends(m, "torch", "torch", "torch")
        be = m.model.layers[0].self_attn.backend
        assert isinstance(be, TorchMLABackend) and be.cpu_flash
        orig = be.forward
        be.forward = lambda *a: calls.append(be._flash_path(*a[:3])) or orig(*a)

    res = check_model(
        model,
        [Variant("torch attention, CPU flash", flash)],
        [decode_batch(1, 40), decode_batch(8, 40), prefix_prefill_batch()],
        reference=reference_setup,
        log=lambda s: None,
    )
    assert calls and all(calls)  # the variant ran the flash path
    assert all(r.ok for r in res), [r.line() for r in res]
