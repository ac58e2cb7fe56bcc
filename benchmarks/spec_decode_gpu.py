"""Speculative decoding on one GPU: the cost of a verify step against its bandwidth floor, the
MoE kernel path of a few-token step, and decode speed at a controlled acceptance length.
k2-slice INT4 (real K2 sizes, dummy weights), the engine's own path.

Run (one H100/H200, from the repo root):
    PYTHONPATH=src python3 benchmarks/spec_decode_gpu.py                  # 8 layers, all parts
    PYTHONPATH=src python3 benchmarks/spec_decode_gpu.py --layers 3 --parts verify,moe
    PYTHONPATH=src python3 benchmarks/spec_decode_gpu.py --device cpu --preset small \\
        --layers 2 --parts e2e --ctx 64 --out-tokens 200 --e2e-batches 1,4   # a CPU check

The model is "peaked" (weights.random_init.peak_logits, --no-peaked to skip): the embedding is
scaled and lm_head row j is a multiple of the embedding row of pred(j), so the greedy next token
is a fixed successor of the current one by a margin far above bf16 rounding (dummy weights'
near-uniform logits otherwise flip near-ties between a verify step's and a decode step's batch
shapes). Every layer still runs at full cost with its own routing.

Parts:
- verify: B requests at context --ctx each; one engine step where every request carries K drafts
  (the model's own continuation: 1 + K = 2..6 new tokens each, logits at every position) against
  the 1-token decode step of the same batch (CUDA graph replay, as served; "graph rows": the
  bucket a step replays, padding rows computed too). Printed: ms, the
  ratio to the 1-token step, the distinct routed experts the step hits per MoE layer (counted in
  one eager step), and the bandwidth floor ratio: bytes a K+1-token step must read over the
  bytes of the 1-token step, from the model's per-layer byte mix (attention, dense / shared
  expert, router, each distinct routed expert, lm_head, the KV read once), with this model's
  routing and with uniform routing; the same floor for the full K2 (61 layers, vocab 163840).
- moe: one MoE layer's routed experts (its FusedMoEBackend) at T = 1..6 tokens, the per-pair
  decode GEMV (what a 2..6-token step runs: it reads an expert once per (token, expert) pair)
  against the grouped decode GEMV (each distinct expert once per block), each in a CUDA graph,
  on this model's routing of a verify step, on "q=0.5" routing (each token keeps each of the
  previous token's experts with probability 0.5: a stand-in for real routing locality) and on
  "shared" routing (every token the same 8 experts: the most double reads); outputs checked
  equal first.
- e2e: decode tok/s at B = 1 and 16 with drafts whose acceptance is controlled: the drafter
  proposes the target's own greedy continuation (recorded in a run without speculation), each
  draft token kept with probability p and otherwise replaced by a wrong one, so the acceptance
  length is about 1 + p + ... + p^K (2.0 / 2.7 / 3.3 at K = 4 for p = 0.5 / 0.7 / 0.8); and B =
  32 with disable_by_batch_size=16 (speculation off above 16 running requests), and at the
  acceptance-3.0 point (p = 0.741 at K = 4). Against speculation off in the same process, runs
  alternating (benchmarks/spec_decode_e2e.py); outputs checked equal (greedy, exact); the part
  FAILs first if the peaked model follows its chain for < 98% of the greedy tokens.
- draft: the EAGLE-3 draft step (K=3) of each head layout (MLA, Llama) at full K2.5 sizes
  (vocabulary 163840, draft vocabulary 32000) against the target step, B = the first two of
  --e2e-batches; not in the default --parts.
Timings: median of --iters steps after warm-up (synchronised around each).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import statistics
import sys
import time
import traceback

import torch
from spec_decode_common import (  # noqa: E402 - benchmarks/ is sys.path[0]
    CTX,
    _free,
    _graph_ms,
    _nbytes,
    _sync_time,
    byte_mix,
    floor_bytes,
    k2_floor,
    k25_vocab,
    make_engine,
    model_dir,
    moe_layers,
    routed_ids,
    time_propose,
    uniform_distinct,
    verify_step,
)
from spec_decode_e2e import e2e  # noqa: E402 - benchmarks/ is sys.path[0]


def graph_rows(eng, rows: int) -> str:
    """The rows a step of `rows` one-token sequences replays (its graph bucket: the padding
    rows, token 0 at position 0, are computed and routed too), or "eager"."""
    gr = eng.runner.graph_runner
    if gr is None or rows > gr.buckets[-1]:
        return "eager"
    return str(next(b for b in gr.buckets if b >= rows))


def verify_costs(path: str, batches: list[int], ctx: int, iters: int) -> None:
    from k2serve.engine.sampling_params import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 5}
    print(f"## verify step cost, context {ctx}")
    for B in batches:
        t0 = time.perf_counter()
        eng = make_engine(path, max(B, 1), spec)
        mix = byte_mix(eng.model, ctx)
        if B == batches[0]:
            parts = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in mix["parts"].items())
            print(f"byte mix (all layers): {parts}; one routed expert {mix['expert'] / 1e6:.1f} "
                  f"MB x {mix['moe_layers']} MoE layers; KV {mix['kv_row'] / 1e6:.1f} MB a "
                  "request")  # fmt: skip
            print("| B | 1+K | graph rows | ms | x 1-token graph step | distinct experts / "
                  "layer (pairs) | floor ratio, this routing | floor ratio, uniform "
                  "| full K2 floor, uniform |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
        rng = random.Random(B)
        params = SamplingParams(temperature=0, max_tokens=4096 - ctx - 64, ignore_eos=True,
                                speculative_decoding=False)  # fmt: skip
        for i in range(B):
            eng.add_request(str(i), [rng.randrange(10, 2000) for _ in range(ctx)], params)
        while any(r.num_output_tokens == 0 for r in eng._requests.values()):
            eng.step()  # prefill
        times = {}
        for k, eager in [(0, False), (0, True)] + [(k, False) for k in range(1, 6)]:
            for _ in range(3):
                verify_step(eng, k, eager)
            step = functools.partial(verify_step, eng, k, eager)
            times[(k, eager)] = statistics.median(_sync_time(step) for _ in range(iters))
        base = times[(0, False)]
        one = None
        for k in range(0, 6):
            ids = routed_ids(eng, k)
            distinct = statistics.mean(t.unique().numel() for t in ids) if ids else 0.0
            by = floor_bytes(mix, distinct, B)
            one = by if k == 0 else one
            uni = floor_bytes(mix, uniform_distinct(mix["E"], mix["top_k"], B * (k + 1)), B)
            uni1 = floor_bytes(mix, uniform_distinct(mix["E"], mix["top_k"], B), B)
            t = times[(k, False)]
            full = B == 1 and eng.model.config.hidden_size == 7168  # K2 layer sizes
            k2 = f"{k2_floor(mix, k + 1):.2f}x" if full else "-"
            pairs = B * (k + 1) * mix["top_k"]
            print(f"| {B} | {k + 1} | {graph_rows(eng, B * (k + 1))} | {t:.2f} | "
                  f"{t / base:.2f}x | {distinct:.1f} ({pairs}) | "
                  f"{by / one:.2f}x | {uni / uni1:.2f}x | {k2} |")  # fmt: skip
        print(f"(B={B}: eager 1-token step {times[(0, True)]:.2f} ms; 1-token floor "
              f"{one / 1e9:.2f} GB; {time.perf_counter() - t0:.0f}s)")  # fmt: skip
        eng.abort_request([str(i) for i in range(B)])
        while eng.has_unfinished_requests():
            eng.step()
        eng.check_integrity()
        del eng
        _free()


def consecutive_ids(T: int, E: int, k: int, q: float, seed: int) -> torch.Tensor:
    """[T, k] routing of consecutive tokens: each keeps each of the previous token's experts
    with probability q, the rest uniform among the others (as cpu_moe.consecutive_routing)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g)[:k]]
    for _ in range(1, T):
        keep = rows[-1][torch.rand(k, generator=g) < q]
        taken = set(keep.tolist())
        rest = [e for e in torch.randperm(E, generator=g).tolist() if e not in taken]
        rows.append(torch.cat([keep, torch.tensor(rest[: k - keep.numel()])]))
    return torch.stack(rows).long()


def moe_paths(path: str, ctx: int) -> None:
    """Per-pair against grouped decode GEMV on one MoE layer at T = 1..6 (see the docstring)."""
    from k2serve.engine.sampling_params import SamplingParams
    from k2serve.kernels.int4_gemv import int4_moe_decode, int4_moe_decode_grouped
    from k2serve.moe.fused_moe import FusedMoEBackend

    eng = make_engine(path, 1, {"method": "ngram", "num_speculative_tokens": 5})
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True,
                            speculative_decoding=False)  # fmt: skip
    eng.add_request("0", [random.Random(0).randrange(10, 2000) for _ in range(ctx)], params)
    while any(r.num_output_tokens == 0 for r in eng._requests.values()):
        eng.step()
    moe = moe_layers(eng.model)
    be = moe[0].expert_backend
    if not isinstance(be, FusedMoEBackend) or not be.use_planes:
        print(f"## moe: layer backend {type(be).__name__} is not the INT4 planes path; skipped")
        return
    w = be.weights
    gcfg = dict(be.grouped_config or {"BLOCK_M": 8, "BLOCK_N": 16, "W": 64, "num_warps": 4})
    print("## one MoE layer's routed experts at T tokens: per-pair vs grouped decode GEMV "
          f"(CUDA graph; dispatch now: per-pair up to {be.decode_max_pairs} pairs, grouped "
          f"{be.grouped_min_pairs}..{be.grouped_max_pairs}); one expert "
          f"{_nbytes(moe[0].experts[0]) / 1e6:.1f} MB")  # fmt: skip
    print("| T | routing | distinct experts | pairs | per-pair ms | grouped ms (BLOCK_M) | "
          "per-pair GB/s of distinct bytes | max rel diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    ex_bytes = _nbytes(moe[0].experts[0])
    D = w.hidden
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in range(1, 7):
        real = routed_ids(eng, T - 1)[0]  # [T, top_k] this model's routing of a verify step
        shared = real[:1].expand(T, -1).contiguous()  # every token the same experts
        local = consecutive_ids(T, w.num_experts, real.shape[1], 0.5, T)
        for name, ids in (("model", real), ("q=0.5", local), ("shared", shared)):
            ids = ids.to("cuda")
            x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
            tw = torch.rand(ids.shape, device="cuda", generator=gen) / ids.shape[1]
            bm = min(8, 1 << max(0, (T - 1).bit_length()))
            cfg = {**gcfg, "BLOCK_M": bm}
            cfg["w2"] = {**gcfg.get("w2", {}), "BLOCK_M": bm}
            pp = functools.partial(int4_moe_decode, x, w, tw, ids, be.decode_config, be.asm)
            gr = functools.partial(int4_moe_decode_grouped, x, w, tw, ids, cfg, be.asm)
            a, b = pp().float(), gr().float()
            diff = ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item()
            t_pp, t_gr = _graph_ms(pp), _graph_ms(gr)
            n = ids.unique().numel()
            print(f"| {T} | {name} | {n} | {ids.numel()} | {t_pp:.3f} | {t_gr:.3f} ({bm}) | "
                  f"{n * ex_bytes / t_pp / 1e6:.0f} | {diff:.1e}"
                  f"{' FAIL' if diff > 2e-2 else ''} |")  # fmt: skip
    eng.abort_request(["0"])
    while eng.has_unfinished_requests():
        eng.step()
    del eng
    _free()


def draft_steps(preset: str, layers: int, batches: list[int], ctx: int, iters: int) -> None:
    """The EAGLE-3 draft step (K=3: the head over the step's kept rows, then 2 one-row steps)
    of each head layout at full K2.5 sizes (target hidden 7168, vocabulary 163840, draft
    vocabulary 32000), against the target's step, B requests at context `ctx`."""
    from k2serve.engine.sampling_params import SamplingParams
    from k2serve.weights.eagle3 import write_eagle3_checkpoint

    print(f"## EAGLE-3 draft step, K=3, target vocabulary 163840, draft vocabulary 32000, "
          f"context {ctx}")  # fmt: skip
    print("| head | B | draft step ms | target step ms (with the draft) | draft / target |")
    print("|---|---|---|---|---|")
    path = model_dir(preset, layers)
    cfg = k25_vocab(path)
    try:
        for layout in ("mla", "llama"):
            d = os.path.join(path, f"draft-{layout}")
            eng = None
            try:
                from k2serve.config import ModelConfig

                write_eagle3_checkpoint(d, ModelConfig.from_hf(cfg), layout,
                                        draft_vocab_size=32000)  # fmt: skip
                spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 3}
                eng = make_engine(path, max(batches), spec)
                times = time_propose(eng.drafter.eagle)
                for B in batches:
                    rng = random.Random(B)
                    params = SamplingParams(temperature=0, max_tokens=iters + 8, ignore_eos=True)
                    for i in range(B):
                        p = [rng.randrange(10, 2000) for _ in range(ctx)]
                        eng.add_request(f"{layout}-{B}-{i}", p, params)
                    while any(r.num_output_tokens == 0 for r in eng._requests.values()):
                        eng.step()
                    steps = []
                    times.clear()
                    for _ in range(iters):
                        steps.append(_sync_time(eng.step))
                    while eng.has_unfinished_requests():
                        eng.step()
                    dm, sm = statistics.median(times[2:] or times), statistics.median(steps[2:])
                    print(f"| {layout} | {B} | {dm:.2f} | {sm:.2f} | {dm / sm:.2f} |")
            except Exception:  # noqa: BLE001 - report, go on to the next head
                traceback.print_exc()
                print(f"FAIL: draft {layout}")
            finally:
                del eng
                shutil.rmtree(d, ignore_errors=True)
                _free()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parts", default="verify,moe,e2e")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--preset", default="k2-slice", help="tiny/small: a CPU run of the script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32", help="verify part")
    ap.add_argument("--e2e-batches", default="1,16,32", help="e2e part")
    ap.add_argument("--disable-by-batch-size", type=int, default=16)
    ap.add_argument("--no-peaked", action="store_true", help="keep the plain dummy weights")
    ap.add_argument("--embed-scale", type=float, default=None,
                    help="peaked model: a fixed embedding scale (default: calibrated)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=3, help="e2e: runs of each engine a point")
    ap.add_argument("--experts", type=int, default=None, help="routed experts a MoE layer")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --preset tiny for a smoke run)", file=sys.stderr)
        return 2
    CTX.update(device=args.device, peaked=not args.no_peaked, embed_scale=args.embed_scale)
    path = model_dir(args.preset, args.layers, args.experts)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {dev}, {args.preset} INT4 {args.layers} layers (dummy weights"
          f"{', peaked' if CTX['peaked'] else ''}), {time.strftime('%Y-%m-%d')}")  # fmt: skip
    rc = 0
    try:
        for part in args.parts.split(","):
            t0 = time.perf_counter()
            try:
                if part == "verify":
                    batches = [int(b) for b in args.batches.split(",")]
                    verify_costs(path, batches, args.ctx, args.iters)
                elif part == "moe":
                    if args.device != "cuda":
                        print("## moe: needs CUDA; skipped")
                        continue
                    moe_paths(path, args.ctx)
                elif part == "draft":
                    batches = [int(b) for b in args.e2e_batches.split(",")][:2]
                    draft_steps(args.preset, args.layers, batches, args.ctx, args.iters)
                elif part == "e2e":
                    batches = [int(b) for b in args.e2e_batches.split(",")]
                    if not e2e(path, batches, args.ctx, args.out_tokens, args.k,
                               args.disable_by_batch_size, args.reps):  # fmt: skip
                        print("FAIL: e2e (see above: the peaked model's chain, or speculative "
                              "output differs from speculation off)")  # fmt: skip
                        rc = 1
                else:
                    print(f"unknown part {part!r}")
                    rc = 2
            except Exception:  # noqa: BLE001 - report the part's error, go on to the next
                traceback.print_exc()
                print(f"FAIL: part {part} raised")
                rc = 1
                _free()
            print(f"({part}: {time.perf_counter() - t0:.0f}s)")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
