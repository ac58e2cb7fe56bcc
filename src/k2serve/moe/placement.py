"""Where each routed expert lives: on the GPU (the model's device) or in host memory ("cpu").

Owns: `ExpertPlacement` (per MoE layer, the ids of the experts kept on the GPU), how it is made
from the flags (`make_placement(config, num_gpu_experts, placement_file)`), the routing-count
file format and `RoutingRecorder` (which writes it), and `describe_placement(model)` for
start-up logs.

Invariants:
- Placement is device-agnostic: "gpu" means "the model's device", "cpu" means host memory with
  the CPU computing those experts (k2serve.moe.cpu_experts). On a CPU-only run both are the
  CPU, which is how the split is tested.
- `num_gpu_experts` = routed experts per MoE layer on the GPU, as `k2serve plan` prints it;
  None = all of them. Without counts the GPU gets experts 0..N-1 of every layer; with a counts
  file (`--expert-placement-file`) it gets each layer's N most-routed experts (ties: lower id),
  and layers absent from the file fall back to 0..N-1.
- Counts file (JSON): {"layers": {"<layer index>": [count of expert 0, 1, ...], ...}} (the bare
  {"<layer index>": [...]} is accepted too); one non-negative number per routed expert, layer
  indices are decoder-layer indices of MoE layers.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

import torch

_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class PlacementError(ValueError):
    """A bad --num-gpu-experts or --expert-placement-file; the message names the problem."""


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int  # routed experts per MoE layer
    gpu_experts: dict[int, tuple[int, ...]]  # MoE layer index -> sorted expert ids on the GPU
    source: str = "default"  # how the GPU experts were chosen, for logs

    def on_gpu(self, layer: int, expert: int) -> bool:
        return expert in self._gpu_sets()[layer]

    def device_of(self, layer: int, expert: int) -> str:
        return "gpu" if self.on_gpu(layer, expert) else "cpu"

    def cpu_experts(self, layer: int) -> tuple[int, ...]:
        gpu = self._gpu_sets()[layer]
        return tuple(e for e in range(self.num_experts) if e not in gpu)

    @property
    def all_on_gpu(self) -> bool:
        return all(len(v) == self.num_experts for v in self.gpu_experts.values())

    @property
    def num_cpu_experts_total(self) -> int:
        return sum(self.num_experts - len(v) for v in self.gpu_experts.values())

    def tensor_on_cpu(self, name: str) -> bool:
        """True for a state_dict name of a CPU-placed expert's tensor (loader device map)."""
        m = _EXPERT_RE.match(name)
        if m is None:
            return False
        layer, expert = int(m.group(1)), int(m.group(2))
        return layer in self.gpu_experts and not self.on_gpu(layer, expert)

    def _gpu_sets(self) -> dict[int, frozenset[int]]:
        sets = self.__dict__.get("_sets")
        if sets is None:
            sets = {k: frozenset(v) for k, v in self.gpu_experts.items()}
            object.__setattr__(self, "_sets", sets)
        return sets

    def describe(self, gpu_name: str = "GPU") -> str:
        layers = len(self.gpu_experts)
        if self.all_on_gpu:
            return f"experts: all {self.num_experts} of each of {layers} MoE layers on {gpu_name}"
        per = sorted({len(v) for v in self.gpu_experts.values()})
        n = str(per[0]) if len(per) == 1 else f"{per[0]}-{per[-1]}"
        cpu = self.num_cpu_experts_total
        return (
            f"experts: {n} of {self.num_experts} per MoE layer on {gpu_name}, the rest ({cpu} "
            f"over {layers} MoE layers) in host memory computed on the CPU ({self.source})"
        )


def load_routing_counts(path: str | os.PathLike, config) -> dict[int, list[float]]:
    """Read a counts file (format in the module docstring), validated against `config`."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise PlacementError(f"expert placement file {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise PlacementError(f"expert placement file {path} is not JSON: {e}") from e
    if isinstance(data, dict) and "layers" in data:
        data = data["layers"]
    if not isinstance(data, dict):
        raise PlacementError(f"expert placement file {path}: expected {{'layers': {{...}}}}")
    moe_layers = set(config.moe_layers)
    E = config.n_routed_experts
    out: dict[int, list[float]] = {}
    for key, counts in data.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise PlacementError(
                f"expert placement file {path}: layer key {key!r} is not an int"
            ) from None
        if layer not in moe_layers:
            raise PlacementError(
                f"expert placement file {path}: layer {layer} is not a MoE layer of this model "
                f"(MoE layers {min(moe_layers)}..{max(moe_layers)})"
            )
        ok = isinstance(counts, list) and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0 for c in counts
        )
        if not ok or len(counts) != E:
            raise PlacementError(
                f"expert placement file {path}: layer {layer} needs a list of {E} non-negative "
                "counts (one per routed expert)"
            )
        out[layer] = [float(c) for c in counts]
    return out


def make_placement(
    config, num_gpu_experts: int | None = None, placement_file: str | os.PathLike | None = None
) -> ExpertPlacement:
    """The placement for `--num-gpu-experts` / `--expert-placement-file` (see module doc)."""
    E = config.n_routed_experts
    n = E if num_gpu_experts is None else num_gpu_experts
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= E:
        raise PlacementError(f"num_gpu_experts={num_gpu_experts!r} must be an int in [0, {E}]")
    counts = load_routing_counts(placement_file, config) if placement_file else {}
    gpu: dict[int, tuple[int, ...]] = {}
    for layer in config.moe_layers:
        if layer in counts:
            c = counts[layer]
            hottest = sorted(range(E), key=lambda e: (-c[e], e))[:n]
            gpu[layer] = tuple(sorted(hottest))
        else:
            gpu[layer] = tuple(range(n))
    if placement_file and n < E:
        source = f"hottest by {os.path.basename(os.fspath(placement_file))}"
    elif n < E:
        source = "experts 0..N-1 on the GPU"
    else:
        source = "all on the GPU"
    return ExpertPlacement(E, gpu, source)


class RoutingRecorder:
    """Counts, per MoE layer, how many (token, expert) pairs the router sends to each expert,
    to write a counts file for `--expert-placement-file` (and `k2serve plan`).

    The counts accumulate on the model's device inside the MoE block (`MoE._record_routing`),
    with no host sync, so steps replayed from CUDA graphs are counted too, provided the
    recorder is attached before the graphs are captured. Graph padding rows are excluded by
    `valid` ([max_tokens] int64, 1 = a real row), which the graph runner sets around a padded
    replay (`mark_padding`). `path` + `maybe_flush()`: the file is rewritten (atomically)
    every `flush_every_s` seconds; `flush()` at shutdown. Use as a context manager, or call
    `remove()`."""

    def __init__(
        self,
        model,
        path: str | os.PathLike | None = None,
        flush_every_s: float = 60.0,
        max_tokens: int = 256,
    ) -> None:
        self.path = path
        self.flush_every_s = flush_every_s
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [E] int64
        self._mlps = []
        dev = model.device
        self.valid = torch.ones(max_tokens, dtype=torch.long, device=dev)
        for layer in model.model.layers:
            mlp = layer.mlp
            gate = getattr(mlp, "gate", None)
            if gate is None or not hasattr(mlp, "routing_counts"):
                continue
            c = torch.zeros(gate.num_experts, dtype=torch.long, device=gate.weight.device)
            self.counts[layer.layer_idx] = c
            mlp.routing_counts, mlp.routing_valid = c, self.valid
            self._mlps.append(mlp)
        self._last_flush = time.monotonic()
        model.routing_recorder = self
        self._model = model

    def mark_padding(self, num_real: int, num_rows: int) -> None:
        """Rows num_real..num_rows-1 of the next replay are padding (not counted)."""
        if num_rows > num_real and num_rows <= self.valid.shape[0]:
            self.valid[num_real:num_rows].zero_()

    def unmark_padding(self, num_real: int, num_rows: int) -> None:
        if num_rows > num_real and num_rows <= self.valid.shape[0]:
            self.valid[num_real:num_rows].fill_(1)

    def remove(self) -> None:
        for mlp in self._mlps:
            mlp.routing_counts = mlp.routing_valid = None
        self._mlps = []
        if getattr(self._model, "routing_recorder", None) is self:
            self._model.routing_recorder = None

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def to_dict(self) -> dict:
        return {"layers": {str(k): v.tolist() for k, v in sorted(self.counts.items())}}

    def save(self, path: str | os.PathLike) -> None:
        """Write the counts file; atomic (a reader never sees half a file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)

    def flush(self) -> None:
        if self.path is not None:
            self.save(self.path)
        self._last_flush = time.monotonic()

    def maybe_flush(self) -> bool:
        """Flush when `flush_every_s` has passed since the last one (one host sync then)."""
        if self.path is None or time.monotonic() - self._last_flush < self.flush_every_s:
            return False
        self.flush()
        return True


def describe_placement(model) -> str:
    """One line for start-up logs: where the model's routed experts live."""
    p = getattr(model, "expert_placement", None)
    dev = str(getattr(model, "device", "GPU"))
    if p is None:
        cfg = model.config
        p = make_placement(cfg)
    return p.describe(dev)


__all__ = [
    "ExpertPlacement",
    "PlacementError",
    "RoutingRecorder",
    "describe_placement",
    "load_routing_counts",
    "make_placement",
]
