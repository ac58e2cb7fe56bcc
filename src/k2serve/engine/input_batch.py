"""Host-side building of a step's flat batch: numpy per step instead of Python lists per token.

Owns: `BlockTables` (each request's page list kept in a persistent numpy row across steps, so a
decode step copies no page ids at all, only the gather of the batch's rows) and `to_device` (the
step's small integer arrays packed into one buffer per dtype: one host->device copy each,
from pinned memory on CUDA, instead of one pageable copy per field).

Invariants:
- `BlockTables.gather` returns, for each scheduled request, exactly the first `num_pages[b]`
  pages of its `kv.req_pages` list, padded with page 0 (what the attention backends expect).
- A row is refreshed whenever its request's page list changed identity (freed and allocated
  again after a preemption) or shrank; new pages at the end are copied incrementally.
- Rows of requests that no longer hold pages are reused only when rows run out (a sweep), so a
  finished request costs nothing per step.
"""

from __future__ import annotations

import numpy as np
import torch


class _Row:
    __slots__ = ("row", "pages", "num_copied", "owner")

    def __init__(self, row: int, pages: list[int], owner) -> None:
        self.row = row
        self.pages = pages
        self.num_copied = 0
        self.owner = owner  # the Request


class BlockTables:
    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        self.buf = np.zeros((num_rows, width), dtype=np.int32)  # [rows, max pages]
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def _take_row(self, req_pages: dict[str, list[int]]) -> int:
        if not self._free:
            self._sweep(req_pages)
        if not self._free:
            n = self.buf.shape[0]
            self.buf = np.concatenate([self.buf, np.zeros_like(self.buf)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _sweep(self, req_pages: dict[str, list[int]]) -> None:
        for rid in [rid for rid, e in self._rows.items() if req_pages.get(rid) is not e.pages]:
            self._free.append(self._rows.pop(rid).row)

    def row_of(self, req, pages: list[int], req_pages: dict[str, list[int]]) -> int:
        """The request's row, brought up to date with `pages` (its current page list)."""
        rid = req.request_id
        e = self._rows.get(rid)
        if e is None or e.pages is not pages or e.num_copied > len(pages) or e.owner is not req:
            if e is not None:
                self._free.append(e.row)
            e = self._rows[rid] = _Row(self._take_row(req_pages), pages, req)
        n = len(pages)
        if n > e.num_copied:
            if n > self.buf.shape[1]:
                width = max(n, 2 * self.buf.shape[1])
                grown = np.zeros((self.buf.shape[0], width), dtype=np.int32)
                grown[:, : self.buf.shape[1]] = self.buf
                self.buf = grown
            self.buf[e.row, e.num_copied : n] = pages[e.num_copied :]
            e.num_copied = n
        return e.row

    def gather(self, rows: list[int], num_pages: np.ndarray) -> np.ndarray:
        """[B, max(num_pages)] int32: row b holds its first num_pages[b] pages, then zeros."""
        width = int(num_pages.max())
        table = self.buf[rows, :width]  # fancy index: a copy
        table[np.arange(width)[None, :] >= num_pages[:, None]] = 0
        return table


_ALIGN = 16  # bytes: each packed field starts 16-byte aligned (what kernels specialize on)


def pack(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Same-dtype arrays raveled into one buffer, each starting 16-byte aligned; returns the
    buffer and each array's offset (in elements)."""
    step = _ALIGN // arrays[0].dtype.itemsize
    offsets, total = [], 0
    for a in arrays:
        assert a.dtype == arrays[0].dtype, (a.dtype, arrays[0].dtype)
        offsets.append(total)
        total += -(-a.size // step) * step
    packed = np.zeros(total, dtype=arrays[0].dtype)
    for a, off in zip(arrays, offsets, strict=True):
        packed[off : off + a.size] = a.ravel()
    return packed, offsets


def unpack(
    packed: torch.Tensor, offsets: list[int], arrays: list[np.ndarray]
) -> list[torch.Tensor]:
    return [
        packed[off : off + a.size].view(a.shape) for a, off in zip(arrays, offsets, strict=True)
    ]


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copy same-dtype host arrays to `device` in one transfer; returns views of the result in
    the arrays' shapes. On CPU the arrays are wrapped without a copy."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    packed, offsets = pack(arrays)
    host = torch.from_numpy(packed)
    if device.type == "cuda":
        # NOTE: the caching host allocator keeps this pinned block until the copy is done
        host = host.pin_memory()
    return unpack(host.to(device, non_blocking=True), offsets, arrays)
