"""Routing measured while serving: the counts file (`--record-routing`) and the dynamic
re-placement of each layer's GPU experts (`--dynamic-expert-placement`, KT's
--kt-enable-dynamic-expert-update).

Owns: `swap_experts` (exchange one GPU-resident and one CPU-resident expert of a hybrid layer),
`replace_layer` / `DynamicPlacer` (move each layer's most-routed experts to the GPU), and
`RoutingService` (what the model runner calls: after every step, and at shutdown).

Invariants:
- A swap moves weights, never storage: the GPU slot that held expert g receives expert c's
  tensors (copied in place, so stacked kernels' views and CUDA graphs that baked the
  addresses stay valid) and the CPU slot of c receives g's; the two modules trade places in
  `MoE.experts`, so `experts[e]` (and the state_dict) always holds expert e's weights.
- The id maps are updated in place (`gpu_local_of` on the device, the CPU backend's
  `local_of`/`expert_ids` on the host), so captured decode graphs read the new maps; the CPU
  backend is then rebuilt over the same modules (HybridExpertBackend.refresh_cpu_backend).
- Re-placement happens only between steps (the runner calls it), never inside a forward.
- Scores decay: each re-placement halves the previous score and adds the counts since, so
  the placement follows the current traffic.
"""

from __future__ import annotations

import logging

import torch

from k2serve.moe.placement import ExpertPlacement, RoutingRecorder

logger = logging.getLogger(__name__)


def _tensors(module) -> list[torch.Tensor]:
    return list(module.state_dict(keep_vars=True).values())


@torch.no_grad()
def swap_experts(moe, gpu_expert: int, cpu_expert: int) -> None:
    """Put `cpu_expert` on the GPU and `gpu_expert` on the CPU in `moe` (a hybrid MoE block)."""
    be = moe.expert_backend
    cpu = be.cpu_backend
    j = int(be.gpu_local_of[gpu_expert])  # GPU slot of gpu_expert
    s = int(cpu.local_of[cpu_expert])  # CPU slot of cpu_expert
    if j < 0 or s < 0:
        raise ValueError(f"expert {gpu_expert} is not on the GPU or {cpu_expert} not on the CPU")
    a, b = moe.experts[gpu_expert], moe.experts[cpu_expert]  # a: GPU storage, b: CPU storage
    for ta, tb in zip(_tensors(a), _tensors(b), strict=True):
        tmp = ta.detach().to("cpu", copy=True)
        ta.copy_(tb)  # host -> device
        tb.copy_(tmp)
    moe.experts[gpu_expert], moe.experts[cpu_expert] = b, a  # experts[e] holds expert e
    ids = list(be.gpu_expert_ids)
    ids[j] = cpu_expert
    be.gpu_expert_ids = tuple(ids)
    be.gpu_local_of[cpu_expert] = j
    be.gpu_local_of[gpu_expert] = -1
    cids = list(cpu.expert_ids)
    cids[s] = gpu_expert
    cpu.expert_ids = tuple(cids)
    cpu.local_of[gpu_expert] = s
    cpu.local_of[cpu_expert] = -1
    for name in ("cpu_local_of",):  # device copy of the CPU map (layer-wise GPU prefill)
        m = getattr(be, name, None)
        if m is not None:
            m[gpu_expert], m[cpu_expert] = s, -1


def replace_layer(moe, scores: torch.Tensor) -> int:
    """Make the layer's GPU experts its highest-scoring ones (ties keep the current placement,
    then the lower id). Returns the number of swaps."""
    be = moe.expert_backend
    n = len(be.gpu_expert_ids)
    if n == 0 or not be.cpu_backend.expert_ids:
        return 0
    sc = scores.tolist()
    cur = set(be.gpu_expert_ids)
    want = sorted(range(len(sc)), key=lambda e: (-sc[e], e not in cur, e))[:n]
    leaving = sorted(cur - set(want), key=lambda e: (sc[e], e))
    coming = sorted(set(want) - cur, key=lambda e: (-sc[e], e))
    for g, c in zip(leaving, coming, strict=True):
        swap_experts(moe, g, c)
    if coming:
        be.refresh_cpu_backend()  # a native CPU kernel keeps its own copy of the id map
    return len(coming)


class DynamicPlacer:
    """Every `interval` steps, re-place each hybrid layer's experts from the recorder's
    counts (see the module docstring)."""

    def __init__(self, model, recorder: RoutingRecorder, interval: int) -> None:
        self.model = model
        self.recorder = recorder
        self.interval = interval
        self.steps = 0
        self.moes = {}
        for layer in model.model.layers:
            be = getattr(layer.mlp, "expert_backend", None)
            if getattr(be, "name", None) == "hybrid" and layer.layer_idx in recorder.counts:
                self.moes[layer.layer_idx] = layer.mlp
        self._seen = {i: recorder.counts[i].to("cpu", copy=True) for i in self.moes}
        self._score = {i: torch.zeros(c.shape, dtype=torch.float64) for i, c in self._seen.items()}

    def step(self) -> int:
        """Count one engine step; re-place when due. Returns the number of swaps made."""
        self.steps += 1
        if self.steps % self.interval or not self.moes:
            return 0
        return self.replace_now()

    @torch.no_grad()
    def replace_now(self) -> int:
        swaps = 0
        for i, moe in self.moes.items():
            now = self.recorder.counts[i].to("cpu", copy=True)  # host sync, every `interval`
            self._score[i] = self._score[i] * 0.5 + (now - self._seen[i]).to(torch.float64)
            self._seen[i] = now
            swaps += replace_layer(moe, self._score[i])
        if swaps:
            self._update_placement()
            lw = getattr(self.model, "layerwise_prefill", None)
            if lw is not None:
                lw.invalidate()
            logger.info("dynamic expert placement: %d experts moved to the GPU", swaps)
        return swaps

    def _update_placement(self) -> None:
        old = self.model.expert_placement
        gpu = dict(old.gpu_experts)
        for i, moe in self.moes.items():
            gpu[i] = tuple(sorted(moe.expert_backend.gpu_expert_ids))
        new = ExpertPlacement(old.num_experts, gpu, "dynamic, from measured routing")
        self.model.expert_placement = new


class RoutingService:
    """The runner's hook: the recorder (`--record-routing FILE`) and the dynamic placer."""

    def __init__(
        self, model, record_routing: str | None, dynamic: bool, interval: int, max_tokens: int
    ) -> None:
        self.recorder = RoutingRecorder(model, record_routing, max_tokens=max_tokens)
        self.placer = DynamicPlacer(model, self.recorder, interval) if dynamic else None

    @classmethod
    def from_settings(
        cls,
        model,
        *,
        record_routing: str | None,
        dynamic: bool,
        interval: int = 1000,
        max_tokens: int = 256,
    ) -> RoutingService | None:
        """None when neither recording nor dynamic placement is on."""
        if not (record_routing or dynamic):
            return None
        return cls(model, record_routing, dynamic, interval, max_tokens)

    def after_step(self) -> None:
        self.recorder.maybe_flush()
        if self.placer is not None:
            self.placer.step()

    def close(self) -> None:
        self.recorder.flush()


__all__ = ["DynamicPlacer", "RoutingService", "replace_layer", "swap_experts"]
