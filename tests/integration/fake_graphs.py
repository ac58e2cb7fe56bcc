"""A CPU stand-in for CUDA graphs: records the torch ops a capture runs and replays them.

`TapeGraphFactory` has the interface of k2serve.model.cuda_graph.CudaGraphFactory. A captured
"graph" keeps every aten op with the tensors it read and wrote; `replay()` re-runs them and
writes each result into the tensor the capture produced, so, as with a CUDA graph, a replay
reads the current contents of the captured inputs and writes the same output tensors. Ops that
need the host to see device data (`.item()`, `nonzero`, ...) raise, as they break a CUDA
graph capture; so does anything shape-dependent that the tape would bake in.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                if isinstance(o, torch.Tensor) and o is not n:
                    o.copy_(n)


class TapeGraphFactory:
    def __init__(self) -> None:
        self.captured: list[TapeGraph] = []

    def capture(self, fn):
        tape = _Tape()
        with tape:
            result = fn()
        g = TapeGraph(tape.ops)
        self.captured.append(g)
        return g, result

    def synchronize(self) -> None:
        pass
