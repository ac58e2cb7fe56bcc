"""Helpers of benchmarks/spec_decode_gpu.py: the model directory and engine (peaked), a verify
step with the model's own drafts, the routed experts a step hits, and the bandwidth floor of a
step from the model's byte mix (see that file's docstring)."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import tempfile
import time

import torch

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "k2serve", "demo", "kimi-k2-demo")
# set once by main; read by make_engine / _sync. embed_scale: None calibrates peak_logits
CTX = {"device": "cuda", "peaked": True, "embed_scale": None}


def model_dir(preset: str, layers: int, experts: int | None = None) -> str:
    """An INT4 `preset` config of `layers` layers (`experts` routed experts a MoE layer when
    given: a k2-slice that fits a laptop) with the demo's tokenizer (vocab 2048)."""
    from k2serve.weights.presets import preset_config

    out = tempfile.mkdtemp(prefix="k2-spec-")
    cfg = preset_config(preset, "int4", layers=layers)
    if experts is not None:
        cfg["n_routed_experts"] = experts
    with open(os.path.join(DEMO, "config.json")) as f:
        demo = json.load(f)
    for k in ("vocab_size", "bos_token_id", "eos_token_id"):
        cfg[k] = demo[k]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DEMO, name), out)
    return out


def _sync() -> None:
    if CTX["device"] == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if CTX["device"] == "cuda":
        torch.cuda.empty_cache()


def make_engine(path: str, max_seqs: int, spec=None, enforce_eager=False):
    """The engine; with CTX["peaked"] its model peaked in place (graphs keep their pointers).
    Sets eng.succ: the greedy successor of each token (None when not peaked)."""
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine
    from k2serve.weights.random_init import peak_logits

    eng = LLMEngine(EngineConfig(
        model=path, load_format="dummy", dtype="bfloat16", device=CTX["device"],
        max_model_len=4096, max_num_seqs=max_seqs, max_num_batched_tokens=8192,
        num_kv_pages=4096, page_size=16,
        enforce_eager=enforce_eager, speculative_config=spec,
    ))  # fmt: skip
    eng.succ = None
    if CTX["peaked"]:
        eng.succ = peak_logits(eng.model, embed_scale=CTX.get("embed_scale"))
        info = ", ".join(f"{k} {v:.3g}" for k, v in eng.model.peak_info.items())
        print(f"(peaked: {info})")
    return eng


def k25_vocab(path: str) -> dict:
    """Give the checkpoint at `path` K2.5's vocabulary size (token ids only: its tokenizer
    files are removed, none of that size exists here); returns the new config."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 163840
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(path, name))
    return cfg


def time_execute(eng) -> list[float]:
    """Wrap `eng.runner.execute` so each call's seconds (synced: the step samples to the host
    right after, so the sync costs nothing) are appended to the returned list."""
    inner, spent = eng.runner.execute, []

    def execute(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        _sync()
        spent.append(time.perf_counter() - t)
        return out

    eng.runner.execute = execute
    return spent


def time_propose(prop) -> list[float]:
    """Wrap the drafter's `prop.propose` so each call's milliseconds (synced before and after)
    are appended to the returned list; `del prop.propose` undoes it."""
    inner, times = prop.propose, []

    def timed(want, sched):
        _sync()
        t = time.perf_counter()
        inner(want, sched)
        _sync()
        times.append((time.perf_counter() - t) * 1e3)

    prop.propose = timed
    return times


def chain_fraction(succ, outputs: list[list[int]]) -> tuple[int, int]:
    """(greedy tokens that are the successor of the token before, tokens checked)."""
    pairs = [(a, b) for o in outputs for a, b in zip(o, o[1:], strict=False)]
    return sum(b == int(succ[a]) for a, b in pairs), len(pairs)


def _sync_time(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t) * 1e3


def drafts_for(eng, req, k: int) -> list[int]:
    """k drafts a request would be verified with: the peaked model's own continuation (what
    an accepted draft is), else tokens drawn from the request's id (no model to follow)."""
    last = req.all_token_ids[-1]
    if eng.succ is None:
        rng = random.Random(last * 7919 + len(req.all_token_ids))
        return [rng.randrange(10, eng.vocab_size) for _ in range(k)]
    out = []
    for _ in range(k):
        last = int(eng.succ[last])
        out.append(last)
    return out


def verify_step(eng, k: int, eager: bool) -> None:
    """One step of every running request carrying k drafts (0: the plain decode step); no
    update, so the same positions are computed again each time."""
    sch, runner = eng.scheduler, eng.runner
    for r in sch.running:
        r.spec_token_ids = drafts_for(eng, r, k)
    out = sch.schedule()
    graph = runner.graph_runner
    if eager:
        runner.graph_runner = None
    try:
        runner.execute(out, eng.kv)
    finally:
        runner.graph_runner = graph
    for r in sch.running:
        r.spec_token_ids = []


def moe_layers(model) -> list:
    return [ly.mlp for ly in model.model.layers if hasattr(ly.mlp, "experts")]


def routed_ids(eng, k: int) -> list[torch.Tensor]:
    """topk_ids [rows, top_k] of each MoE layer in one eager step with k drafts a request."""
    got: list[torch.Tensor] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, o: got.append(o[1].detach().clone()))
             for m in moe_layers(eng.model)]  # fmt: skip
    try:
        verify_step(eng, k, eager=True)
    finally:
        for h in hooks:
            h.remove()
    return got


def _nbytes(mod) -> int:
    return sum(t.numel() * t.element_size() for t in mod.parameters()) if mod is not None else 0


def byte_mix(model, ctx: int) -> dict:
    """What one forward must read (bytes): `fixed` (attention + norms, dense MLPs, shared
    experts, routers, lm_head: read once whatever the row count), `expert` (one routed expert),
    `kv_row` (one request's latent KV over all layers at `ctx`), and the parts for the print."""
    c = model.config
    mix = {"attention": 0, "dense mlp": 0, "shared expert": 0, "router": 0}
    for ly in model.model.layers:
        mix["attention"] += _nbytes(ly.self_attn) + _nbytes(ly.input_layernorm)
        mix["attention"] += _nbytes(ly.post_attention_layernorm)
        if hasattr(ly.mlp, "experts"):
            mix["shared expert"] += _nbytes(ly.mlp.shared_experts)
            mix["router"] += _nbytes(ly.mlp.gate)
        else:
            mix["dense mlp"] += _nbytes(ly.mlp)
    mix["lm_head"] = _nbytes(model.lm_head) + _nbytes(model.model.norm)
    fixed = sum(mix.values())
    moe = moe_layers(model)
    expert = _nbytes(moe[0].experts[0]) if moe else 0
    kv_row = ctx * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * len(model.model.layers)
    return {"parts": mix, "fixed": fixed, "expert": expert, "kv_row": kv_row,
            "moe_layers": len(moe), "E": c.n_routed_experts,
            "top_k": c.num_experts_per_tok}  # fmt: skip


def uniform_distinct(E: int, k: int, rows: int) -> float:
    """Expected distinct experts hit by `rows` tokens each routed to k of E uniformly."""
    return E * (1 - (1 - k / E) ** rows)


def floor_bytes(mix: dict, distinct: float, requests: int) -> float:
    """Bytes of a step whose MoE layers hit `distinct` experts each (mean)."""
    return mix["fixed"] + mix["moe_layers"] * distinct * mix["expert"] + requests * mix["kv_row"]


def k2_floor(mix: dict, rows: int) -> float:
    """Uniform-routing floor ratio of a `rows`-token step at B=1 for the full K2 (61 layers, 1
    dense, vocab 163840), scaled from this model's per-layer mix (same layer sizes)."""
    c_layers = mix["moe_layers"] + (1 if mix["parts"]["dense mlp"] else 0)
    per = {k: v / max(c_layers, 1) for k, v in mix["parts"].items() if k != "lm_head"}
    dense = mix["parts"]["dense mlp"]
    n_moe = max(mix["moe_layers"], 1)
    fixed = 61 * per["attention"] + dense + 60 * (mix["parts"]["shared expert"] / n_moe)
    fixed += 60 * (mix["parts"]["router"] / n_moe) + 163840 * 7168 * 2
    E, k = mix["E"], mix["top_k"]

    def total(n: int) -> float:
        return fixed + 60 * uniform_distinct(E, k, n) * mix["expert"]

    return total(rows) / total(1)


def _graph_ms(fn, iters: int = 50) -> float:
    """ms of fn() replayed from a CUDA graph (eager timing on a failed capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    except Exception as e:  # noqa: BLE001 - report and time eagerly
        print(f"(graph capture failed: {type(e).__name__}: {e}; eager timing)")
        run = fn
    run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        run()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters
