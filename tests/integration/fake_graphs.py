"""A CPU stand-in for CUDA graphs: records the torch ops a capture runs and replays them.

`TapeGraphFactory` has the interface of k2serve.model.cuda_graph.CudaGraphFactory. A captured
"graph" keeps every aten op with the tensors it read and wrote; `replay()` re-runs them and
writes each result into the tensor the capture produced, so, as with a CUDA graph, a replay
reads the current contents of the captured inputs and writes the same output tensors. Ops that
need the host to see device data (`.item()`, `nonzero`, ...) raise, as they break a CUDA
graph capture; so does anything shape-dependent that the tape would bake in.

`GraphSafeMLA`: the torch MLA backend with a decode path such a capture can take (no host sync).

`StreamTapeGraphFactory` replays on a "device" thread (one FIFO, like a CUDA stream) and gives
host signals (the interface of kernels.stream_wait.CudaHostSignal) whose `gpu_wait()` is a step
of the tape that blocks that thread until the host releases it: the device-wait overlap of
hybrid layers runs here as on a GPU, the host computing while the "device" goes on.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from k2serve.attention.torch_ref import TorchMLABackend

aten = torch.ops.aten
HOST_SYNC_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.bincount,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave.Tensor,  # tensor repeats: the output size is data
    aten.repeat_interleave.self_Tensor,
}


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC_OPS or func.overloadpacket in HOST_SYNC_OPS:
            raise RuntimeError(f"{func} syncs with the host: not capturable in a CUDA graph")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class TapeGraph:
    def __init__(self, ops) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for op in self.ops:
            if callable(op):  # a host-signal wait captured into the tape
                op()
                continue
            func, args, kwargs, out = op
            new = func(*args, **kwargs)
            for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                if isinstance(o, torch.Tensor) and o is not n:
                    o.copy_(n)


class TapeGraphFactory:
    def __init__(self) -> None:
        self.captured: list[TapeGraph] = []
        self.capturing: _Tape | None = None

    def capture(self, fn):
        tape = _Tape()
        self.capturing = tape
        try:
            with tape:
                result = fn()
        finally:
            self.capturing = None
        g = self._graph(tape.ops)
        self.captured.append(g)
        return g, result

    def _graph(self, ops):
        return TapeGraph(ops)

    def synchronize(self) -> None:
        pass


TIMEOUT_S = 30.0  # a wait never released fails the test instead of hanging it


class _StreamGraph(TapeGraph):
    def __init__(self, ops, factory) -> None:
        super().__init__(ops)
        self.factory = factory

    def replay(self) -> None:  # launched, not run: the device thread runs it
        self.factory.enqueue(self._run)

    @torch.inference_mode()  # as the runner that launched it
    def _run(self) -> None:
        super().replay()


class FakeHostSignal:
    def __init__(self, factory) -> None:
        self.factory = factory
        self.released = threading.Event()
        self.reached: concurrent.futures.Future | None = None
        self.waits = 0  # gpu_wait() steps the device thread passed

    def record(self) -> None:
        self.reached = self.factory.enqueue(lambda: None)

    def wait_recorded(self) -> None:
        self.reached.result(TIMEOUT_S)

    def gpu_wait(self) -> None:
        tape = self.factory.capturing
        if tape is None:
            raise RuntimeError("gpu_wait() outside a capture")
        tape.ops.append(lambda: self._device_wait())

    def _device_wait(self) -> None:
        if not self.released.wait(TIMEOUT_S):
            raise TimeoutError("the host never released this wait")
        self.released.clear()
        self.waits += 1

    def release(self) -> None:
        self.released.set()

    def reset(self) -> None:
        self.released.clear()


class StreamTapeGraphFactory(TapeGraphFactory):
    def __init__(self) -> None:
        super().__init__()
        self.device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fake-gpu")
        self.launched: list[concurrent.futures.Future] = []
        self.signals: list[FakeHostSignal] = []

    def _graph(self, ops):
        return _StreamGraph(ops, self)

    def enqueue(self, fn) -> concurrent.futures.Future:
        self.launched.append(self.device.submit(fn))
        return self.launched[-1]

    def host_signal(self) -> FakeHostSignal:
        self.signals.append(FakeHostSignal(self))
        return self.signals[-1]

    def synchronize(self) -> None:
        launched, self.launched = self.launched, []
        for f in launched:
            f.result(TIMEOUT_S)  # re-raises a step's error


class GraphSafeMLA(TorchMLABackend):
    """TorchMLABackend with a host-sync-free decode path: every page of the block table, the
    keys past the sequence length masked; padding rows (slot -1) written to slot 0 first and
    then overwritten by the real rows (CPU index_put writes in order)."""

    graph_safe = True

    def store(self, kv_cache, latent, k_pe, slot_mapping):
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        keep = slot_mapping >= 0
        idx = torch.where(keep, slot_mapping, torch.zeros_like(slot_mapping))
        new = torch.cat([latent, k_pe], dim=-1).to(flat.dtype)
        flat[idx.flip(0)] = torch.where(keep[:, None], new, flat[idx]).flip(0)

    def forward(self, q_latent, q_pe, kv_cache, md, scale):
        if md.max_query_len != 1:
            return super().forward(q_latent, q_pe, kv_cache, md, scale)
        B, L = q_latent.shape[0], q_latent.shape[-1]
        kv = kv_cache[md.block_table.long()].reshape(B, -1, kv_cache.shape[-1]).float()
        s = torch.einsum("bhl,bsl->bhs", q_latent.float(), kv[..., :L])
        s = (s + torch.einsum("bhr,bsr->bhs", q_pe.float(), kv[..., L:])) * scale
        pos = torch.arange(kv.shape[1])
        s = s.masked_fill((pos[None, :] >= md.seq_lens[:, None])[:, None, :], float("-inf"))
        return torch.einsum("bhs,bsl->bhl", s.softmax(-1), kv[..., :L]).to(q_latent.dtype)
