"""CPU-only decode through the LLM API against the CPU's memory bandwidth, in one run.

Builds (or takes) a Kimi-K2-shaped INT4 checkpoint with the real sizes (hidden 7168, experts
of width 2048, top-8, vocab 163840) and few layers (default 3: one dense + two MoE layers);
--experts lowers the routed experts per layer to fit small machines (a token still reads 8 of
them per layer, so its bytes are those of the full model's layers). Then:
  LLM(model, device="cpu") -> greedy decode of --tokens tokens at batch 1;
  decode time per token = (time for 1 + N tokens - time for 1 token) / N;
  bytes a token must read = every weight at its stored size, except the embedding (one row)
  and the routed experts it does not hit (8 of each MoE layer's are read);
  read bandwidth = the best of a multi-threaded read of a --bw-gib GiB buffer.

    python benchmarks/cpu_e2e.py --experts 64              # makes the checkpoint in a temp dir
    python benchmarks/cpu_e2e.py --model DIR

--full-k2 (no checkpoint, no LLM): the full Kimi-K2 (61 layers: 1 dense, 60 MoE; bf16 attention,
shared expert, dense MLP and lm_head; INT4 routed experts) EXTRAPOLATED from parts of one layer
measured on this CPU with the model's own code paths (quant.linear.linear, the CPU expert kernel,
TorchMLABackend, cpu_head_gemv, TopkRouter), each over weights that miss the caches: a per-part
byte mix of a decode token (MB, ms, GB/s, % of the read bandwidth measured in the same run),
decode tok/s at --context tokens of context (and at --also-context), prefill tok/s for 2K and
16K prompts (per-token parts measured at prompt-sized chunks, attention's quadratic part from a
per-key cost measured at 8K), and a hybrid one-GPU decode figure whose GPU part is an
assumption (printed), not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def read_bandwidth(gib: float, reps: int = 5) -> float:
    from cpu_quiet import read_gbs  # benchmarks/cpu_quiet.py

    return read_gbs(torch.ones(int(gib * 2**30) // 4, dtype=torch.float32), reps)


def token_bytes(model) -> tuple[int, int]:
    """(bytes a decode token reads, bytes of all weights) at their stored size."""
    total = per_token = 0
    k = model.config.num_experts_per_tok
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        total += b
        if "embed_tokens" in name:
            per_token += p.shape[-1] * p.element_size()  # one row
        elif ".mlp.experts." in name:
            n_exp = model.config.n_routed_experts
            per_token += b * k / n_exp  # k of the layer's experts
        else:
            per_token += b
    return int(per_token), total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: make one)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--bw-gib", type=float, default=2.0)
    ap.add_argument("--full-k2", action="store_true", help="full-K2 extrapolation from parts")
    ap.add_argument("--context", type=int, default=2048, help="--full-k2: decode context")
    ap.add_argument("--also-context", default="1024",
                    help="--full-k2: other decode contexts (comma-separated; '' for none): the "
                         "MLA timed there too, a decode figure printed for each")  # fmt: skip
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE: build the CPU kernel with this define (a variant, "
                         "its own cache entry; a *_LEGACY=1 switch: before/after)")  # fmt: skip
    ap.add_argument("--chunk", type=int, default=2048, help="--full-k2: prefill chunk tokens")
    ap.add_argument("--mla", choices=("auto", "flash", "ref"), default="auto",
                    help="--full-k2: the decode's MLA as the engine runs it (auto), torch's "
                         "flash kernel, or the float32 einsums (ref)")  # fmt: skip
    ap.add_argument("--gpu-tbs", type=float, default=2.7,
                    help="--full-k2: the GPU's effective TB/s for the hybrid figure (H100: "
                         "3.35 peak x ~0.8)")  # fmt: skip
    ap.add_argument("--timing", choices=("quiet", "legacy"), default="quiet",
                    help="--full-k2: each decode part beside an idle torch OpenMP team, median, "
                         "bandwidth probed per part (quiet), or the previous best-of-3 right "
                         "after building the weights (legacy)")  # fmt: skip
    ap.add_argument("--router-topk", choices=("kernel", "torch"), default="kernel",
                    help="--full-k2: the router part as the engine runs it at decode (kernel: "
                         "logits and top-k in one CPU kernel call) or with the top-k in torch "
                         "ops after the kernel's GEMV (torch: before)")  # fmt: skip
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="--full-k2: skip the prefill parts and figures (saves time)",
    )
    args = ap.parse_args(argv)
    args.also_context = [int(c) for c in args.also_context.split(",") if c]
    if args.define:
        from k2serve.kernels import cpu as ck

        ck.CXX_FLAGS = ck.CXX_FLAGS + tuple(f"-D{d}" for d in args.define)
        print(f"# CPU kernel built with {args.define}")
    if args.full_k2:
        from cpu_e2e_k2 import full_k2  # benchmarks/cpu_e2e_k2.py

        return full_k2(args, read_bandwidth(args.bw_gib))
    from k2serve import LLM
    from k2serve.engine.sampling_params import SamplingParams

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from k2serve.weights.make_checkpoint import make_checkpoint
        from k2serve.weights.presets import preset_config

        cfg = preset_config("k2-slice", "int4", args.layers)
        cfg["n_routed_experts"] = args.experts
        tmp = tempfile.TemporaryDirectory(prefix="k2-cpu-e2e-")
        model_dir = tmp.name
        t0 = time.perf_counter()
        make_checkpoint(model_dir, cfg, progress=False)
        print(f"# checkpoint: k2-slice int4, {args.layers} layers, {args.experts} experts "
              f"({time.perf_counter() - t0:.0f}s)")  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cpu", dtype=args.dtype, max_model_len=512, max_num_seqs=1)
    model = llm.llm_engine.model
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    print(f"# loaded in {time.perf_counter() - t0:.0f}s; dtype {dtype}; "
          f"{torch.get_num_threads()} threads; {llm.llm_engine.spec.backends.moe} experts backend "
          f"{model.model.layers[-1].mlp.expert_backend.name}")  # fmt: skip
    per_token, total = token_bytes(model)
    prompt = list(range(100, 116))
    sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    spn = SamplingParams(temperature=0, max_tokens=1 + args.tokens, ignore_eos=True)
    llm.generate(prompt, sp1)  # warm-up (kernel build, first-touch)
    t0 = time.perf_counter()
    llm.generate(prompt, sp1)
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate(prompt, spn)
    tn = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == 1 + args.tokens
    per_tok = (tn - t1) / args.tokens
    bw = read_bandwidth(args.bw_gib)
    gbs = per_token / per_tok / 1e9
    print(f"# weights {total / 1e9:.2f} GB; a decode token reads {per_token / 1e9:.3f} GB")
    print(f"decode: {per_tok * 1e3:.1f} ms/token ({1 / per_tok:.2f} tok/s), {gbs:.1f} GB/s = "
          f"{gbs / bw:.0%} of the {bw:.1f} GB/s read bandwidth measured in this run")  # fmt: skip
    llm.close()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
