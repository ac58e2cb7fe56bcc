"""Functions the expert-parallel test ranks run (module level: spawned workers import them)."""

import torch

from k2serve.distributed.expert_parallel import EPContext, shard_model_ep
from k2serve.moe.eplb import ExpertMap
from k2serve.weights.loader import load_model


def skewed_map(config, world: int, redundant: int) -> ExpertMap:
    """A balanced map for a routing where low expert ids are hot (the same on every rank)."""
    L, E = len(config.moe_layers), config.n_routed_experts
    load = (1000 / torch.arange(1, E + 1) ** 1.5).repeat(L, 1)
    return ExpertMap.balanced(load, E + redundant, world)


def moe_vs_single(
    state, ckpt: str, redundant: int, tokens: list[int], ids: list[list[int]], device="cpu"
):
    """Rank r: its MoE layers' output on tokens[r] random rows and the model's logits on
    ids[r], single-process (whole model) and expert-parallel. -> (max |diff| per layer,
    bitwise equal per layer, logits max rel diff, logits of the EP model)."""
    torch.set_num_threads(1)
    r, W = state.rank, state.world_size
    dev = state.device if device != "cpu" else torch.device("cpu")
    model = load_model(ckpt, dtype=torch.float32, device=dev, progress=False,
                       setup_backends=False)  # fmt: skip
    g = torch.Generator().manual_seed(100 + r)
    xs = {}
    refs = {}
    for i in model.config.moe_layers:
        x = torch.randn(tokens[r], model.config.hidden_size, generator=g).to(dev)
        xs[i], refs[i] = x, model.model.layers[i].mlp(x)
    t = torch.tensor(ids[r], dtype=torch.int64, device=dev)
    ref_logits = model.compute_logits(model(t, torch.arange(len(t), device=dev)))
    emap = (
        skewed_map(model.config, W, redundant)
        if redundant
        else ExpertMap.contiguous(len(model.config.moe_layers), model.config.n_routed_experts, W)
    )
    ctx = EPContext(r, W, emap)
    plan = shard_model_ep(model, ctx)
    ctx.load = ctx.load.to(dev)
    assert plan.dropped, "every rank drops the experts of the other ranks"
    diffs, equal = [], []
    for i in model.config.moe_layers:
        out = model.model.layers[i].mlp(xs[i])
        diffs.append(float((out - refs[i]).abs().max()) if out.numel() else 0.0)
        equal.append(bool(torch.equal(out, refs[i])))
    logits = model.compute_logits(model(t, torch.arange(len(t), device=dev)))
    rel = float((logits - ref_logits).abs().max() / ref_logits.abs().max()) if len(t) else 0.0
    return diffs, equal, rel, ctx.take_load().sum().item()


def rebalance_mid_run(state, ckpt: str, redundant: int, tokens: int):
    """Rank r: EP MoE outputs before and after an EPLB rebalance (weights moved between the
    ranks), against one process. -> (equal before, equal after, experts received, imbalance
    before/after the rebalance, the map's logical experts on this rank after)."""
    from k2serve.distributed.eplb_runtime import EplbRunner
    from k2serve.moe.eplb import EplbConfig

    torch.set_num_threads(1)
    r, W = state.rank, state.world_size
    model = load_model(ckpt, dtype=torch.float32, progress=False, setup_backends=False)
    c = model.config
    g = torch.Generator().manual_seed(7 + r)
    # skewed tokens: scale rows so the router prefers a few experts (the same bias on all ranks)
    layers = c.moe_layers
    xs = [torch.randn(tokens, c.hidden_size, generator=g) for _ in range(3)]
    refs = [[model.model.layers[i].mlp(x) for i in layers] for x in xs]
    L, E = len(layers), c.n_routed_experts
    ctx = EPContext(r, W, ExpertMap.identity(L, E, W, redundant))
    shard_model_ep(model, ctx)
    runner = EplbRunner(model, EplbConfig(window_size=4, step_interval=2,
                                          num_redundant_experts=redundant))  # fmt: skip
    eq = []
    for x, ref in zip(xs, refs, strict=True):
        outs = [model.model.layers[i].mlp(x) for i in layers]
        eq.append(max(float((a - b).abs().max()) for a, b in zip(outs, ref, strict=True)))
        runner.after_step()  # the second step rebalances
    held = [model.model.layers[i].mlp.experts.logical_ids for i in layers]
    return eq, runner.num_rebalances, runner.last_imbalance, held
