"""Gluon import guard shared by the Gluon kernels (as `_triton.py` is for Triton).

Owns: whether Triton's Gluon dialect with the Hopper API the kernels use can be imported
(`HAS_GLUON`), and the names the kernels take from it: `triton`, `gluon`, `gl` and the Hopper
modules `async_copy`, `fence_async_shared`, `mbarrier`, `warpgroup_mma`, `warpgroup_mma_wait`.

Invariants: importing k2serve never requires Triton or Gluon: without them (or with another
Gluon API) `HAS_GLUON` is False and the names are None; the kernel modules define their
kernels only under `if HAS_GLUON:`. Whether the version is the one the kernels are written
against (3.6) is int4_gemm_gluon.gluon_available's call.
"""

from __future__ import annotations

try:  # pragma: no cover - depends on the installed Triton
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
except Exception:  # noqa: BLE001 - no Triton, no Gluon, or another Gluon API
    triton = gluon = gl = None
    async_copy = fence_async_shared = mbarrier = warpgroup_mma = warpgroup_mma_wait = None
    HAS_GLUON = False
