"""The engine's own per-step overhead (no model cost) at batch 1-256, and the HTTP path per token.

Run from the repo root:
    PYTHONPATH=src .venv/bin/python benchmarks/engine_overhead.py                # B = 1,16,64,256
    PYTHONPATH=src .venv/bin/python benchmarks/engine_overhead.py --batch 64 --profile  # cProfile
    PYTHONPATH=src .venv/bin/python benchmarks/engine_overhead.py --http         # + HTTP per token

The model is `NullModel`: its forward returns a constant hidden row per token and its logits are
one fixed row per (position mod 16), so its cost is ~nothing and every microsecond measured is
the engine's: scheduler, runner input preparation, sampler, scheduler update, detokenizer (the
demo checkpoint's real Kimi tokenizer), stop-string checks, output objects, and (`async` rows)
the AsyncLLMEngine hand-off to an event loop with B consumers. B requests run decode-only (their
1K-token prompts are prefilled before timing starts), greedy, ignore_eos, until `--steps`.

Phases are timed by wrapping the engine's components on the instance (a clock read around each
call), so the per-phase figures include ~0.2 us of wrapper per call; the `step` column is
measured without wrappers, alternating with the wrapped run. The default clock is CPU time (the
engine thread's; for the async column the whole process's: engine thread + event loop), which
other load on a shared machine barely disturbs; `--clock wall` for wall time. On this CPU
machine `.to(device)` copies are no-ops: what is measured is the host-side Python work, which a
GPU step pays on top of its kernels (or, with CUDA graphs, between replays).
`--compare REF` runs the same measurement on git REF's src and on the working tree, alternating
per batch size (before/after in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass

import torch


class _Clock:
    """cpu (default): the engine thread's CPU time per step and the process's (engine thread +
    event loop) for the async rows, which other load on a shared machine barely disturbs;
    wall: perf_counter."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ns = time.thread_time_ns if name == "cpu" else time.perf_counter_ns
        self.process = time.process_time if name == "cpu" else time.perf_counter


_clock = _Clock("cpu")
_chat_bans = False  # --chat-bans
_model_ms = 0.0  # --model-ms


@dataclass(frozen=True)
class _NullConfig:
    vocab_size: int
    max_position_embeddings: int = 1 << 20
    eos_token_ids: tuple[int, ...] = ()
    num_hidden_layers: int = 1
    kv_cache_dim: int = 1


class NullModel:
    """Forward ~free: hidden = positions, logits = a fixed row chosen by position % 16."""

    device = torch.device("cpu")
    expert_placement = None

    def __init__(self, vocab_size: int, step_s: float = 0.0) -> None:
        self.config = _NullConfig(vocab_size)
        self.step_s = step_s  # sleep per forward: a GPU step's wait, with the GIL released
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(16, vocab_size, generator=g)  # [16, vocab]

    def __call__(self, input_ids, positions, attn_metadata=None, kv_caches=None):
        if self.step_s:
            time.sleep(self.step_s)
        return positions[:, None]  # [T, 1]

    def compute_logits(self, hidden):
        return self.table[hidden[:, 0] % 16]  # [S, vocab]

    def install_backends(self, attention, experts, triton_norm, policy, placement=None) -> str:
        return ""  # no layers: nothing to wire

    def moe_blocks(self) -> list:
        return []

    def parameters(self) -> list:
        return [self.table]


def null_kv_caches(num_pages, page_size, dtype, device):
    return [torch.empty(num_pages, page_size, 1)]


BUDGET = 8192  # max_num_batched_tokens


def _prefill_steps(batch: int, prompt_len: int) -> int:
    """Upper bound of the steps spent prefilling (early requests decode meanwhile)."""
    return -(-batch * prompt_len // BUDGET) + 4


def make_engine(batch: int, prompt_len: int, steps: int):
    from k2serve.demo import demo_path
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine
    from k2serve.engine.setup import load_tokenizer

    tok = load_tokenizer(os.fspath(demo_path()))
    page_size = 16
    steps += _prefill_steps(batch, prompt_len)
    per_req = -(-(prompt_len + steps + 8) // page_size)
    cfg = EngineConfig(
        device="cpu",
        num_kv_pages=per_req * batch + 8,
        page_size=page_size,
        max_model_len=prompt_len + steps + 8,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(BUDGET, batch),
        enable_prefix_caching=True,
    )
    return LLMEngine(
        cfg,
        model=NullModel(tok.vocab_size, _model_ms / 1e3),
        tokenizer=tok,
        kv_cache_factory=null_kv_caches,
    )


def add_requests(engine, batch: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    from k2serve.engine.sampling_params import SamplingParams

    vocab = engine.vocab_size
    procs = []
    if _chat_bans:  # what the chat endpoint adds to every request without tools
        from k2serve.engine.logits_processors import BanTokens

        procs = [BanTokens([vocab - 2, vocab - 1])]
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors=procs
    )
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % (vocab - 300) + 10 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params)


def prefill(engine, batch: int) -> None:
    while (
        any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.waiting)
        or len(engine.scheduler.running) < batch
    ):
        engine.step()
    engine.step()  # every request now decodes


class _Timed:
    """Wraps a callable, accumulating its wall time (ns) into `acc[name]`."""

    def __init__(self, fn, name: str, acc: dict) -> None:
        self.fn, self.name, self.acc = fn, name, acc

    def __call__(self, *a, **kw):
        t = _clock.ns()
        try:
            return self.fn(*a, **kw)
        finally:
            self.acc[self.name] = self.acc.get(self.name, 0) + _clock.ns() - t


PHASES = ["schedule", "prepare", "model", "logits", "sample", "update", "detok", "outputs"]


def instrument(engine, acc: dict) -> None:
    r = engine.runner
    engine.scheduler.schedule = _Timed(engine.scheduler.schedule, "schedule", acc)
    r.prepare = _Timed(r.prepare, "prepare", acc)
    model = r.model

    class _M:  # the runner calls self.model(...) and self.model.compute_logits(...)
        def __call__(self, *a, **kw):
            return _Timed(model, "model", acc)(*a, **kw)

        compute_logits = _Timed(model.compute_logits, "logits", acc)

    r.model = _M()
    r.sampler = _Timed(r.sampler, "sample", acc)
    engine.scheduler.update_from_output = _Timed(engine.scheduler.update_from_output, "update", acc)
    # the detokenizer is a module function the engine calls by name (k2serve.engine.detokenize)
    import k2serve.engine.engine as engine_mod

    fn = engine_mod.process_text
    engine_mod.process_text = _Timed(getattr(fn, "fn", fn), "detok", acc)
    engine._make_output = _Timed(engine._make_output, "outputs", acc)


def run_steps(engine, steps: int, acc: dict | None = None, per_step: list | None = None):
    times = []
    for _ in range(steps):
        if acc is not None:
            acc.clear()
        t = _clock.ns()
        engine.step()
        times.append((_clock.ns() - t) / 1e9)
        if per_step is not None:
            per_step.append(dict(acc))
    return times


def bench_sync(batch: int, prompt_len: int, steps: int, rounds: int, profile: bool) -> dict:
    plain_ms = []
    acc: dict = {}
    per_step: list[dict] = []
    for rnd in range(rounds):  # alternate plain and instrumented runs (the machine is shared)
        for wrapped in (False, True):
            eng = make_engine(batch, prompt_len, steps)
            max_tokens = steps + _prefill_steps(batch, prompt_len)
            add_requests(eng, batch, prompt_len, max_tokens, f"r{rnd}")
            prefill(eng, batch)
            if wrapped:
                instrument(eng, acc)
            prof = cProfile.Profile() if (profile and wrapped and rnd == 0) else None
            if prof:
                prof.enable()
            ts = run_steps(eng, steps, acc if wrapped else None, per_step if wrapped else None)
            if prof:
                prof.disable()
                print(f"\n--- cProfile, B={batch}, {steps} steps (tottime) ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            if not wrapped:
                plain_ms.extend(t * 1e3 for t in ts)
    # NOTE: the lower quintile: on a shared machine long steps get descheduled mid-way
    step = statistics.quantiles(plain_ms, n=5)[0]
    per_phase = {k: statistics.median(d.get(k, 0) for d in per_step) / 1e6 for k in PHASES}
    return {"batch": batch, "step_ms": step, "phases": per_phase}


async def _consume(engine, prompt, params, rid, log: list) -> None:
    # log: (time, tokens so far) per output received
    n = 0
    async for out in engine.generate(prompt, params, rid):
        n += len(out.outputs[0].token_ids)
        log.append((time.perf_counter(), n, _clock.process()))


def bench_async(batch: int, prompt_len: int, steps: int) -> dict:
    """AsyncLLMEngine with B consumers on an event loop: ms per decode step, taken over the
    window where every request decodes (after the last first token, before the first finish)."""
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.sampling_params import SamplingParams

    eng = make_engine(batch, prompt_len, steps)
    aeng = AsyncLLMEngine(engine=eng)
    vocab = eng.vocab_size
    max_tokens = steps + _prefill_steps(batch, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [
        [(i * 7919 + j * 31) % (vocab - 300) + 10 for j in range(prompt_len)] for i in range(batch)
    ]
    logs: list[list] = [[] for _ in range(batch)]

    async def main():
        await asyncio.gather(
            *(_consume(aeng, p, params, f"a{i}", logs[i]) for i, p in enumerate(prompts))
        )

    try:
        asyncio.run(main())
    finally:
        aeng.shutdown()
    assert all(log[-1][1] == max_tokens for log in logs)
    t0 = max(log[0][0] for log in logs)
    t1 = min(log[-1][0] for log in logs)
    # tokens request 0 received inside the window = decode steps in it
    n0, c0 = next((n, c) for t, n, c in logs[0] if t >= t0)
    n1, c1 = max((n, c) for t, n, c in logs[0] if t <= t1)
    spent = (c1 - c0) if _clock.name == "cpu" else None
    spent = spent if spent is not None else (t1 - t0)
    return {"batch": batch, "ms_per_step": spent / max(n1 - n0, 1) * 1e3}


def bench_http(batches: list[int], prompt_len: int, steps: int) -> None:
    """`k2serve serve` in miniature: the real app over AsyncLLMEngine(NullModel engine) on
    loopback, C concurrent streamed chat completions (max_tokens=steps, ignore_eos); prints the
    served output tok/s next to what the engine's own step rate allows (served/engine ratio),
    the SSE chunks sent (fewer than tokens when deltas were merged) and the process's CPU time
    (engine thread + server + client) per output token. The client runs in this process too
    (its cost is included), so the ratio is a lower bound for the server alone."""
    import httpx

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.server.conftest import ServerThread

    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.server.app import build_app

    word = "lorem "
    print("\n| C | served out tok/s | engine-only tok/s | served/engine | chunks | CPU us/token |")
    print("|---|---|---|---|---|---|")
    for conc in batches:
        eng = make_engine(conc, 2 * prompt_len + 64, steps)
        aeng = AsyncLLMEngine(engine=eng)
        per_word = len(eng.tokenizer.encode(word * 8)) / 8
        text = word * int(prompt_len / per_word)  # ~prompt_len tokens
        body = {
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "max_tokens": steps,
            "ignore_eos": True,
            "temperature": 0,
            "chat_template_kwargs": {"thinking": False},
        }

        async def one(client, body=body) -> int:
            n = 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
            return n

        async def main(url, conc=conc, one=one):
            limits = httpx.Limits(max_connections=conc + 8)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
                await one(c)  # warm-up
                t0, c0 = time.perf_counter(), time.process_time()
                chunks = sum(await asyncio.gather(*(one(c) for _ in range(conc))))
                return time.perf_counter() - t0, time.process_time() - c0, chunks

        try:
            with ServerThread(build_app(aeng, served_model_names=["null"])) as srv:
                wall, cpu, chunks = asyncio.run(main(srv.url))
        finally:
            aeng.shutdown()
        served = conc * steps / wall
        # the engine alone over the same requests (prefill included), wall clock
        e2 = make_engine(conc, 2 * prompt_len + 64, steps)
        ids = e2.tokenizer.encode(text)
        from k2serve.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        for i in range(conc):
            e2.add_request(f"e{i}", ids, params)
        t0 = time.perf_counter()
        while e2.has_unfinished_requests():
            e2.step()
        alone = conc * steps / (time.perf_counter() - t0)
        print(
            f"| {conc} | {served:,.0f} | {alone:,.0f} | {served / alone:.2f} | {chunks} | "
            f"{cpu / (conc * steps) * 1e6:.0f} |",
            flush=True,
        )


def compare(ref: str, argv: list[str]) -> None:
    """Run this script on `git archive ref src` and on the working tree, alternating per batch
    size, each in its own process (same machine, same minute)."""
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", root, "archive", ref, "src"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        skip = ("--http", "--no-engine")  # compare covers the engine rows only
        args = ap_args = [a for a in argv if not a.startswith("--compare") and a not in skip]
        batches = "1,16,64,256"
        if "--batch" in args:
            i = args.index("--batch")
            batches = args[i + 1]
            ap_args = args[:i] + args[i + 2 :]
        for b in batches.split(","):
            for label, src in (
                (ref, os.path.join(tmp, "src")),
                ("tree", os.path.join(root, "src")),
            ):
                env = dict(os.environ, PYTHONPATH=src)
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--batch", b, *ap_args],
                    env=env, check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                row = [line for line in out.splitlines() if line.startswith(f"| {b} |")][-1]
                print(f"| {label} {row[2:]}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile the first wrapped run")
    ap.add_argument("--no-async", action="store_true", help="skip the AsyncLLMEngine rows")
    ap.add_argument("--http", action="store_true", help="also serve it over HTTP (served/engine)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine rows (with --http)")
    ap.add_argument(
        "--chat-bans", action="store_true", help="each request bans 2 tokens, as chat does"
    )
    ap.add_argument(
        "--model-ms",
        type=float,
        default=0.0,
        help="NullModel sleeps this long per forward (a GPU step: the GIL is released)",
    )
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--compare", metavar="REF", help="alternate with git REF's src (before/after)")
    args = ap.parse_args(argv)
    global _clock, _chat_bans, _model_ms
    _clock = _Clock(args.clock)
    _chat_bans = args.chat_bans
    _model_ms = args.model_ms
    if args.compare:
        argv = sys.argv[1:] if argv is None else argv
        print(f"# {args.compare} vs working tree, alternating, one process per row")
        return compare(args.compare, [a for a in argv if a not in ("--compare", args.compare)])
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batch.split(",")]
    print(
        f"# engine overhead, NullModel, prompt {args.prompt_len}, {args.steps} decode steps, "
        f"{args.clock} time"
    )
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
    head = "| B | step ms | us/token | " + " | ".join(PHASES) + " | async ms/step |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for b in batches if not args.no_engine else ():
        r = bench_sync(b, args.prompt_len, args.steps, args.rounds, args.profile)
        a = None if args.no_async else bench_async(b, args.prompt_len, args.steps)
        cells = " | ".join(f"{r['phases'][k]:.3f}" for k in PHASES)
        a_cell = f"{a['ms_per_step']:.3f}" if a else "-"
        print(
            f"| {b} | {r['step_ms']:.3f} | {r['step_ms'] / b * 1e3:.1f} | {cells} | {a_cell} |",
            flush=True,
        )
    if args.http:
        bench_http(batches, args.prompt_len, args.steps)


if __name__ == "__main__":
    main()
