"""Kernel tests run on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1 is set
here before Triton is imported when no GPU is present). Without Triton they skip."""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore = []
try:
    import triton  # noqa: F401
except ImportError:  # no Triton: the kernel tests are skipped, not failed
    collect_ignore = ["test_kernels.py", "test_mla_fp8.py", "test_moe_select.py"]


BLOCK_GLUON = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.startswith('triton.experimental'):\n"
    "            raise ImportError('blocked')\n"
    "sys.meta_path.insert(0, Block())\n"
)


@pytest.fixture
def run_without_gluon():
    """run(body): `body` (Python source that prints 'ok') in a fresh interpreter where Triton's
    Gluon cannot be imported (CPU CI: no Triton, or another Triton's API)."""

    def run(body: str) -> None:
        r = subprocess.run([sys.executable, "-c", BLOCK_GLUON + body], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

    return run


@pytest.fixture
def chosen_paths(monkeypatch):
    """The candidate index moe_select picks at each routing-band step of a FusedMoEBackend
    (appended as the steps run; the real selection still decides)."""
    from k2serve.moe import fused_moe as be_mod

    chosen: list[int] = []
    real = be_mod.moe_select

    def spy(*a):
        sel = real(*a)
        chosen.append(sel[:-1].argmax().item())
        return sel

    monkeypatch.setattr(be_mod, "moe_select", spy)
    return chosen
