"""The host-memory tier under the paged latent cache (design decision 17: one cache, two tiers).

Two halves, split along the engine / rank line:
- `HostTier` (the engine, next to `KVCacheManager`): the bookkeeping. A second `BlockPool` of
  host pages keyed by the same chained block hashes. A hashed device page that drops to no
  reference is written back to host (once per hash, a bounded number of pages a step), so by
  the time the device pool evicts it its content is already in RAM; a prefix hit in host RAM
  gets fresh device pages and a copy back; a preempted request's pages are swapped out to host
  pages it holds (ref counted, like the device's) and back in. Every copy is queued as an op
  in `KVTransfers`, handed to the ranks with the step that follows.
- `KVCopier` (every rank, each on its own replica of the cache): owns the host buffer
  (`[num_host_pages, num_layers, page]`, pinned on CUDA) and issues a step's ops in order on
  a side CUDA stream (plain copies on the CPU).

Ordering invariants (why no step waits on the host for a copy):
- All copies of a rank run on one stream, in the order the bookkeeping planned them, so a host
  page is never read before it is written nor overwritten before it is read.
- The copy stream waits (GPU side) for the compute stream before each step's copies, so a
  write-back sees every KV the earlier steps wrote.
- A request restored from host (prefix hit or swap-in) computes in the same step when its load
  is small (`IMMEDIATE_LOAD_BYTES`: that step's compute waits for it, on the GPU; on the CPU
  every copy is synchronous anyway); else it holds its pages and computes from the
  first step after rank 0's copy stream reports its loads done (`loads_done`, a non-blocking
  event poll); that step's compute waits (GPU side) for the same loads on every rank, which on
  rank 0 is free. So the copy overlaps compute and no step waits for it. Restored device pages
  join the device prefix cache at the same point (`KVCacheManager.begin_step`).
- The compute stream waits for a copy only if it is about to overwrite a page that copy may
  still touch (`KVTransfers.fresh`: a write-back in flight, rare since a written-back page sits
  at the back of the device LRU, or the load of a request aborted meanwhile); the count is
  `stall_waits`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from k2serve.cache.block_pool import BlockPool

logger = logging.getLogger(__name__)

D2H, H2D = "d2h", "h2d"
# a load this small is waited for by the step that needs it (~0.3 ms at PCIe 4 x16 speed)
IMMEDIATE_LOAD_BYTES = 8 << 20
# write-backs issued per step at most (bounds the copy launches a step's host work pays)
WRITE_BACK_BYTES_PER_STEP = 128 << 20


@dataclass
class KVTransfers:
    """The copies of one step, run in order on every rank before its forward."""

    ops: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # (kind, src, dst)
    fresh: list[int] = field(default_factory=list)  # device pages handed out since the last step
    seq: int = 0  # numbers the steps that copy (their loads complete in this order)
    wait_seq: int = 0  # this step computes requests whose loads came with seq <= wait_seq
    wait_now: bool = False  # and requests whose (small) loads come with this very step

    def __bool__(self) -> bool:
        return bool(self.ops)

    def add(self, kind: str, src: int, dst: int) -> None:
        if self.ops and self.ops[-1][0] == kind:
            self.ops[-1][1].append(src)
            self.ops[-1][2].append(dst)
        else:
            self.ops.append((kind, [src], [dst]))

    def num_pages(self, kind: str) -> int:
        return sum(len(s) for k, s, _ in self.ops if k == kind)


class HostTier:
    """Host pages' bookkeeping (the engine's side); see the module docstring."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        bytes_per_page: int,
        immediate_bytes: float = IMMEDIATE_LOAD_BYTES,
        write_back_bytes: int = WRITE_BACK_BYTES_PER_STEP,
    ) -> None:
        self.pool = BlockPool(num_pages, enable_prefix_caching=True)
        self.immediate_bytes = immediate_bytes  # loads up to this size go with the step
        self.write_back_bytes = write_back_bytes
        self.intents: OrderedDict[int, bytes] = OrderedDict()  # device page -> hash, to copy
        self._write_back_left = max(1, int(write_back_bytes // bytes_per_page))  # this step
        self.page_size = page_size
        self.bytes_per_page = bytes_per_page
        self.pending = KVTransfers()
        self.swapped: dict[str, list[int]] = {}  # request id -> host pages it holds
        self.loading: dict[str, int] = {}  # request id -> seq of the step copying its pages in
        self.seq = 0  # of the last transfers with ops handed out
        self.loads_done_seq = 0  # loads of every step up to this seq are done (rank 0's copier)
        self._sent_wait_seq = 0
        # counters (since start)
        self.hit_tokens = 0  # prompt tokens restored from host instead of computed
        self.pages_offloaded = 0  # device -> host (write-back and swap-out)
        self.pages_loaded = 0  # host -> device (prefix hits and swap-in)
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def usage(self) -> float:
        """Fraction of host pages holding content (cached or held by a swapped request)."""
        queue = list(self.pool.free_queue)  # a snapshot (atomic under the GIL): any thread
        free = sum(1 for p in queue if self.pool.page_hash[p] is None)
        return 1.0 - free / self.pool.num_pages

    def take(self) -> KVTransfers | None:
        """What the ranks need this step: the ops planned since the last one, the fresh pages
        (a write-back of one may be in flight) and the loads to wait for (None: nothing)."""
        self._issue_write_backs()  # what the budget has left (after this step's loads: in order)
        t, self.pending = self.pending, KVTransfers()
        t.wait_seq = self.loads_done_seq
        if not (t.ops or t.fresh or t.wait_seq != self._sent_wait_seq):
            return None
        self._sent_wait_seq = t.wait_seq
        if t.ops:
            self.seq += 1
            t.seq = self.seq
        return t

    def ready(self, request_id: str) -> bool:
        """False while the pages of a restored request are still being copied in (it waits,
        holding them, instead of making a step wait for the copy)."""
        seq = self.loading.get(request_id)
        if seq is None:
            return True
        if seq > self.loads_done_seq:
            return False
        del self.loading[request_id]
        return True

    # ---- prefix cache ------------------------------------------------------------------------
    def lookup(self, page_hash: bytes) -> int | None:
        return self.pool.lookup(page_hash)

    def refresh(self, page_hash: bytes) -> None:
        """A device hit on `page_hash`: its host copy becomes most recently used too (one LRU
        order across both tiers)."""
        page = self.pool.hash_to_page.get(page_hash)
        if page is not None and self.pool.ref_count[page] == 0:
            self.pool.free_queue.move_to_end(page)

    def write_back(self, device_page: int, page_hash: bytes) -> None:
        """A device page that just became unreferenced (a cached prefix page): queue its copy
        to host RAM, once per hash. The copies are issued by `take`, at most
        `write_back_bytes` a step (bounded host work per step); one whose device page is
        handed out before that is dropped (`drop`)."""
        if page_hash in self.pool.hash_to_page:
            self.refresh(page_hash)
        else:
            self.intents[device_page] = page_hash

    def drop(self, device_pages: list[int]) -> None:
        """These device pages are handed out again: their content is no longer to be copied."""
        for p in device_pages:
            self.intents.pop(p, None)

    def begin_step(self) -> None:
        """A new step: its write-back budget, and the write-backs queued since the last one
        issued first (before this step hands out any device page)."""
        self._write_back_left = max(1, int(self.write_back_bytes // self.bytes_per_page))
        self._issue_write_backs()

    def _issue_write_backs(self) -> None:
        while self.intents and self._write_back_left > 0:
            device_page, page_hash = self.intents.popitem(last=False)
            if page_hash in self.pool.hash_to_page:
                continue  # copied meanwhile (a swap-out)
            if not self.pool.num_free_pages:
                self.intents.clear()  # every host page is held by swapped requests
                return
            (hp,) = self.pool.allocate(1)  # LRU eviction in host RAM
            self.pool.cache_page(hp, page_hash)
            self.pool.free([hp])  # cached, unreferenced: evictable like any other
            self.pending.add(D2H, device_page, hp)
            self.pages_offloaded += 1
            self._write_back_left -= 1

    def load(self, request_id: str, host_pages: list[int], device_pages: list[int]) -> int:
        """Queue host -> device copies for a request (the host pages may be evicted afterwards:
        the copy stream runs in order). -> the seq `take` will give them. A load of at most
        `immediate_bytes` is waited for by this step's compute (cheaper than a step's delay);
        a larger one makes the request wait, holding its pages, until `ready`."""
        for hp, dp in zip(host_pages, device_pages, strict=True):
            self.pending.add(H2D, hp, dp)
        self.pages_loaded += len(host_pages)
        if len(host_pages) * self.bytes_per_page <= self.immediate_bytes:
            self.pending.wait_now = True
        else:
            self.loading[request_id] = self.seq + 1
        return self.seq + 1

    # ---- swap (preemption) -------------------------------------------------------------------
    def swap_out(
        self, request_id: str, device_pages: list[int], hashes: list[bytes | None]
    ) -> bool:
        """Copy a preempted request's computed pages to host pages it holds (a hashed page
        already in host RAM is shared, not copied). False, changing nothing, if host RAM has
        too few pages that are free or evictable."""
        found = [self.pool.lookup(h) if h is not None else None for h in hashes]
        shared = [hp for hp in found if hp is not None]  # distinct: the hashes are chained
        reclaimed = sum(1 for hp in shared if self.pool.ref_count[hp] == 0)
        if found.count(None) > self.pool.num_free_pages - reclaimed:
            return False
        self.pool.touch(shared)  # first, so the allocations below cannot evict them
        held = []
        for dp, h, hp in zip(device_pages, hashes, found, strict=True):
            if hp is None:
                (hp,) = self.pool.allocate(1)
                if h is not None:
                    self.pool.cache_page(hp, h)
                self.pending.add(D2H, dp, hp)
                self.pages_offloaded += 1
            held.append(hp)
        self.swapped[request_id] = held
        self.num_swap_outs += 1
        return True

    def forget(self, request_id: str) -> None:
        """The request's device pages are gone (finished, aborted, preempted)."""
        self.loading.pop(request_id, None)

    def release(self, request_id: str) -> list[int]:
        """Drop a swapped request's host pages (swapped in, or finished while swapped)."""
        held = self.swapped.pop(request_id, [])
        self.pool.free(held[::-1])
        return held

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for pages in self.swapped.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p in range(self.pool.num_pages):
            if self.pool.ref_count[p] != held.get(p, 0):
                raise AssertionError(
                    f"host page {p}: ref_count {self.pool.ref_count[p]} but held by "
                    f"{held.get(p, 0)} swapped requests"
                )


def _runs(idx: list[int]) -> list[tuple[int, int, int]]:
    """(position in idx, first value, length) of the runs of consecutive values in idx."""
    out: list[tuple[int, int, int]] = []
    for j, v in enumerate(idx):
        if out and out[-1][1] + out[-1][2] == v:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, v, 1))
    return out


def _pin(t: torch.Tensor) -> None:
    """Page-lock a host tensor in place (cudaHostRegister: unlike pin_memory=True, whose
    caching allocator rounds a request up to a power of two, it pins exactly these bytes)."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.nbytes / 2**30:.1f} GiB failed ({rc})")


def _unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


STAGING_BYTES = 64 << 20  # device staging buffer of the copies


class KVCopier:
    """One rank's host buffer and copy engine; see the module docstring.

    Host layout `[num_host_pages, num_layers, words of a page]` (one allocation, pinned on
    CUDA): a host page is contiguous, so a page moves in one memcpy for all layers. Copies go
    through a device staging buffer of whole pages, in chunks: device -> host gathers the
    pages of every layer into it (one `index_select` per layer), then copies each run of
    consecutive host pages; host -> device the other way round (`index_copy_` per layer). So a
    batch of n pages costs ~n / chunk x (layers + runs) launches, not n x layers."""

    def __init__(
        self, kv_caches: list[torch.Tensor], num_host_pages: int, staging_bytes: int = STAGING_BYTES
    ) -> None:
        device = kv_caches[0].device
        self.device = device
        self.cuda = device.type == "cuda"
        # a page as one row of words: fp8 / bf16 / fp32 caches copy alike, and a gather moves
        # whole rows (a uint8 gather was measured ~3x slower than int64 rows on the CPU)
        page_bytes = kv_caches[0][0].numel() * kv_caches[0].element_size()
        word = torch.int64 if page_bytes % 8 == 0 else torch.uint8
        self.device_caches = [
            c.view(torch.uint8).view(c.shape[0], page_bytes).view(word) for c in kv_caches
        ]  # [P, words]
        page = (len(kv_caches), self.device_caches[0].shape[1])  # [L, words]
        self.host = torch.empty((num_host_pages, *page), dtype=word)  # [H, L, words]
        self.bytes_per_page = page_bytes * len(kv_caches)
        if self.cuda:
            _pin(self.host)
            weakref.finalize(self, _unpin, self.host)
        chunk = max(1, min(1024, num_host_pages, staging_bytes // self.bytes_per_page))
        self.staging = torch.empty((chunk, *page), dtype=word, device=device)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._busy: dict[int, torch.cuda.Event] = {}  # device page -> last copy touching it
        self._loads: deque[tuple[int, torch.cuda.Event]] = deque()  # (seq, end) of loads issued
        self._applied_seq = 0  # seq of the last transfers issued
        self._timed: list[tuple[str, int, object, object]] = []  # (kind, bytes, start, end)
        self.bytes_moved = {D2H: 0, H2D: 0}
        self.seconds = {D2H: 0.0, H2D: 0.0}  # time the copies took (CUDA events / wall on CPU)
        self.stall_waits = 0  # forwards that waited for a copy to finish

    @property
    def host_caches(self) -> list[torch.Tensor]:
        """Per layer `[H, words]` views of the host buffer."""
        return [self.host[:, layer] for layer in range(self.host.shape[1])]

    def _index(self, pages: list[int]) -> torch.Tensor:
        t = torch.tensor(pages, dtype=torch.int64)  # [n]
        if self.cuda:  # pinned + non_blocking: a pageable copy would wait for the copy stream
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _copy(self, kind: str, src: list[int], dst: list[int]) -> int:
        dev_pages, host_pages = (src, dst) if kind == D2H else (dst, src)
        dev_idx = self._index(dev_pages)  # [n]
        k = self.staging.shape[0]
        nb = self.cuda
        for c in range(0, len(src), k):
            idx = dev_idx[c : c + k]
            stage = self.staging[: idx.numel()]  # [k, L, words]
            if kind == D2H:
                torch.stack([d.index_select(0, idx) for d in self.device_caches], 1, out=stage)
                for j, h, n in _runs(host_pages[c : c + k]):
                    self.host[h : h + n].copy_(stage[j : j + n], non_blocking=nb)
            else:
                for j, h, n in _runs(host_pages[c : c + k]):
                    stage[j : j + n].copy_(self.host[h : h + n], non_blocking=nb)
                for layer, d in enumerate(self.device_caches):
                    d.index_copy_(0, idx, stage[:, layer])
        return len(src) * self.bytes_per_page

    def apply(self, t: KVTransfers | None) -> None:
        """Issue a step's copies, and make this step's compute wait (on the GPU) for what it
        needs: the loads of the requests it computes, and the write-backs of pages it is about
        to overwrite."""
        if t is None:
            if self.cuda:
                self._collect()
            return
        self._applied_seq = max(self._applied_seq, t.seq)
        if not self.cuda:
            for kind, src, dst in t.ops:
                t0 = time.perf_counter()
                self.bytes_moved[kind] += self._copy(kind, src, dst)
                self.seconds[kind] += time.perf_counter() - t0
            return
        compute = torch.cuda.current_stream(self.device)
        while self._loads and self._loads[0][0] <= t.wait_seq:  # done on rank 0 already
            compute.wait_event(self._loads.popleft()[1])
        self._collect()
        stream = self.stream
        assert stream is not None
        stream.wait_stream(compute)  # write-backs see the KV the earlier steps wrote
        with torch.cuda.stream(stream):
            for kind, src, dst in t.ops:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                nbytes = self._copy(kind, src, dst)
                end.record(stream)
                self._timed.append((kind, nbytes, start, end))
                for p in src if kind == D2H else dst:
                    self._busy[p] = end
                if kind == H2D:
                    self._loads.append((t.seq, end))
        # a page handed out again may still be read by a write-back, or written by the load of
        # a request that was aborted: the forward that writes it waits for that copy
        if t.wait_now:  # small loads of requests computed in this very step
            for seq, ev in self._loads:
                if seq == t.seq:
                    compute.wait_event(ev)
        waits = {id(e): e for p in t.fresh if (e := self._busy.get(p)) is not None}
        for ev in waits.values():
            compute.wait_event(ev)
        self.stall_waits += bool(waits)

    def loads_done(self) -> int:
        """The seq up to which every load issued here is done (a non-blocking poll)."""
        while self._loads and self._loads[0][1].query():
            self._loads.popleft()
        return self._loads[0][0] - 1 if self._loads else self._applied_seq

    def _collect(self) -> None:
        """Account finished copies (non-blocking event queries)."""
        left = []
        for kind, nbytes, start, end in self._timed:
            if end.query():  # type: ignore[attr-defined]
                self.bytes_moved[kind] += nbytes
                self.seconds[kind] += start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
            else:
                left.append((kind, nbytes, start, end))
        self._timed = left
        if self._busy:
            events = {id(e): e for e in self._busy.values()}
            done = {i for i, e in events.items() if e.query()}
            self._busy = {p: e for p, e in self._busy.items() if id(e) not in done}

    def synchronize(self) -> None:
        """Wait for every copy issued (benchmarks, tests, shutdown)."""
        if self.stream is not None:
            self.stream.synchronize()
            self._collect()

    def stats(self) -> dict:
        """Copies accounted so far (finished ones, seen at a step's `apply` or `synchronize`).
        NOTE: read-only, so the server's metrics thread may call it while the engine steps."""
        return dict(
            bytes_d2h=self.bytes_moved[D2H],
            bytes_h2d=self.bytes_moved[H2D],
            seconds_d2h=self.seconds[D2H],
            seconds_h2d=self.seconds[H2D],
            stall_waits=self.stall_waits,
        )


def apply_on_rank(state, transfers: KVTransfers | None) -> None:
    """A tensor-parallel rank: issue a step's copies on its own cache replica (no forward)."""
    copier = state.data.get("kv_copier")
    if copier is not None:
        copier.apply(transfers)
