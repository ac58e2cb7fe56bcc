"""Sharded safetensors checkpoint writer (the Hugging Face layout).

Invariants:
- Shards are `model-00001-of-0000N.safetensors`, each at most `max_shard_bytes` (unless one
  tensor is bigger); `model.safetensors.index.json` has `metadata.total_size` and a
  `weight_map` of every tensor name to its shard.
- Tensors are written as they come and dropped after their shard is flushed: peak memory is
  about one shard.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


class ShardedWriter:
    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3) -> None:
        self.out_dir = os.fspath(out_dir)
        self.max_shard_bytes = max_shard_bytes
        os.makedirs(self.out_dir, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temp file, names)
        self._total = 0
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f".shard-{len(self._shards):05d}.tmp")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index; returns the shard file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map, files = {}, []
        for i, (tmp, names) in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, fname))
            os.chmod(os.path.join(self.out_dir, fname), 0o644)  # save_file makes them 0600
            files.append(fname)
            weight_map.update({name: fname for name in names})
        index = {
            "metadata": {"total_size": self._total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(os.path.join(self.out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        return files
