"""Routings for the benchmarks: which experts the k2-slice's tokens go to.

The k2-slice runs on dummy weights, whose router sends the tokens of a batch to about a third
of the experts (B=128: ~130 of 384 distinct experts per layer); a served K2 spreads them much
more evenly (its router is trained with a load-balancing bias). Every figure that depends on
how many experts a batch hits (decode bytes, the MoE kernels' choice, prefill GEMM shapes) is
therefore given per routing:

- "dummy":   the model's own router on the dummy weights (concentrated);
- "uniform": each token's top-k experts drawn uniformly without replacement;
- "record:FILE": per MoE layer, top-k drawn without replacement with the probabilities of a
  routing counts file (`k2serve serve --record-routing FILE`: {"layers": {layer: [E counts]}});
  the slice's i-th MoE layer takes the file's i-th layer (cyclically).

Owns: `routing_ids` (the [tokens, k] expert ids of one layer), `RoutingOverride` (forward hooks
that replace the router's top-k ids with a fixed table, keeping the router's own cost and its
top-k weights: the model's routers and transformers' DeepseekV3 routers), `parse_modes`.
The table is fixed per layer: token t of a batch always gets row t (CUDA-graph safe: the hook
slices a device tensor).
"""

from __future__ import annotations

import json

import torch


def parse_modes(text: str) -> list[str]:
    """ "dummy,uniform,record:FILE" -> ["dummy", "uniform", "record:FILE"] (checked)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in ("dummy", "uniform") and not m.startswith("record:"):
            raise ValueError(f"routing {m!r}: use dummy, uniform or record:FILE")
    return modes


def load_counts(path: str) -> list[list[int]]:
    """The per-layer counts of a --record-routing file, in layer order."""
    with open(path) as f:
        data = json.load(f)
    layers = data.get("layers", data)
    return [list(map(int, layers[k])) for k in sorted(layers, key=int)]


def routing_ids(
    mode: str,
    tokens: int,
    num_experts: int,
    top_k: int,
    layer: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    counts: list[list[int]] | None = None,
) -> torch.Tensor:  # [tokens, top_k] int64, distinct per row
    """Expert ids of `tokens` tokens for `mode` ("uniform" or "record:FILE"; `counts`: the file
    already read). Gumbel top-k: the k largest of log p + Gumbel noise is a draw without
    replacement with probabilities p."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1009 + layer)
    if mode == "uniform":
        logp = torch.zeros(num_experts)
    elif mode.startswith("record:"):
        c = (counts or load_counts(mode[len("record:") :]))[layer % len(counts or [0])]
        if len(c) != num_experts:
            raise ValueError(f"routing record has {len(c)} experts per layer, model {num_experts}")
        p = torch.tensor(c, dtype=torch.float64) + 1e-3  # never-hit experts: almost never
        logp = (p / p.sum()).log().float()
    else:
        raise ValueError(f"routing_ids: mode {mode!r} has no table (dummy = the model's router)")
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    for s in range(0, tokens, 4096):  # [chunk, E] noise at a time
        n = min(4096, tokens - s)
        u = torch.rand(n, num_experts, generator=g).clamp_(1e-12, 1 - 1e-7)
        ids[s : s + n] = (logp - (-u.log()).log()).topk(top_k, dim=-1).indices
    return ids.to(device)


class RoutingOverride:
    """Forward hooks on each MoE router of `model` (ours, or transformers' DeepseekV3 with
    `hf=True`) that replace its top-k ids by row t of a per-layer table for token t. Use as a
    context manager or call `remove()`. mode "dummy": no hook (the router's own choice)."""

    def __init__(self, model, mode: str, max_tokens: int, *, hf: bool = False, seed: int = 0):
        self.handles = []
        self.mode = mode
        if mode == "dummy":
            return
        counts = load_counts(mode[len("record:") :]) if mode.startswith("record:") else None
        layers = model.model.layers
        moe_i = 0
        for layer in layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(layer.mlp, "experts"):
                continue
            E = gate.weight.shape[0]
            k = model.config.num_experts_per_tok
            table = routing_ids(mode, max_tokens, E, k, moe_i, seed, gate.weight.device, counts)
            self.handles.append(gate.register_forward_hook(self._hook(table, hf)))
            moe_i += 1

    @staticmethod
    def _hook(table: torch.Tensor, hf: bool):
        """The router's output with its integer [T, k] tensor (the top-k ids: ours return
        (weights, ids), transformers' (logits, weights, ids)) replaced by the table's rows."""

        def hook(_mod, _args, out):
            out = list(out)
            i = next(j for j, t in enumerate(out) if isinstance(t, torch.Tensor)
                     and not t.is_floating_point() and t.dim() == 2)  # fmt: skip
            T = out[i].shape[0]
            if T > table.shape[0]:
                raise ValueError(f"routing table has {table.shape[0]} rows, batch has {T}")
            out[i] = table[:T].to(out[i].dtype)
            return tuple(out)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> RoutingOverride:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
