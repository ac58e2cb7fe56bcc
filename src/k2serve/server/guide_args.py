"""The guide spellings on the `k2serve serve` parser: add them (`add_guide_arguments`), act on
the ones given (`apply_guide_flags`: set the k2serve value, warn, or refuse naming the
equivalent), warn about guide environment variables, and render docs/flags.md. The table itself
is `k2serve.server.guide_flags`.
"""

from __future__ import annotations

import argparse
import logging
import os

from k2serve.server.guide_flags import _INT4, ALL_FLAGS, ENV_VARS, GuideFlag

logger = logging.getLogger("k2serve.server")

_KV_DTYPES = {"fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "bfloat16": "bf16"}


def add_guide_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every non-implemented guide spelling the parser does not define yet."""
    g = parser.add_argument_group(
        "spellings of the vLLM / SGLang / KTransformers guides (docs/flags.md)"
    )
    for f in ALL_FLAGS:
        if f.status == "implemented":
            continue
        names = [s for s in f.spellings if s not in parser._option_string_actions]
        if not names:
            continue  # defined by the parser itself (a merged implementation)
        help_ = f"as {f.target}" if f.status == "alias" else f"{f.status}: {f.why}"
        if f.status == "pending":
            help_ = f"accepted; {f.why} is not active in this build"
        if f.switch:
            g.add_argument(*names, dest=f.dest, action="store_true", default=None, help=help_)
        else:
            g.add_argument(
                *names, dest=f.dest, default=None, metavar="VALUE", nargs=f.nargs, help=help_
            )


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r} is not a whole number") from None


def _given_spelling(f: GuideFlag, argv: list[str] | None) -> str:
    for a in argv or ():
        for s in f.spellings:
            if a == s or a.startswith(s + "="):
                return s
    return f.spellings[0]


def apply_guide_flags(args: argparse.Namespace, argv: list[str] | None = None) -> list[str]:
    """Act on the guide spellings that were given: set the k2serve value (alias), log a warning
    (warn / pending), raise ValueError naming the equivalent (refuse, one above 1). Returns the
    warnings logged (one line each)."""
    warnings: list[str] = []
    kv = getattr(args, "kv_cache_dtype", None)
    if kv in _KV_DTYPES:
        args.kv_cache_dtype = _KV_DTYPES[kv]  # vLLM / SGLang spell e4m3 out
    elif kv == "fp8_e5m2":
        raise ValueError("--kv-cache-dtype fp8_e5m2: k2serve's fp8 cache is e4m3; use fp8")
    backend = getattr(args, "attention_backend", None)
    if backend not in (None, "auto", "torch", "triton"):  # SGLang / vLLM backend names
        warnings.append(
            f"--attention-backend {backend}: k2serve's MLA backends are auto|torch|triton; "
            "using auto (Triton on CUDA)"
        )
        args.attention_backend = "auto"
    if getattr(args, "load_format", None) in ("compressed-tensors", "fastsafetensors"):
        warnings.append(f"--load-format {args.load_format}: {_INT4}; reading safetensors")
        args.load_format = "auto"
    for f in ALL_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or f.status == "implemented":
            continue
        flag = _given_spelling(f, argv)
        if isinstance(value, list):
            value = " ".join(value)
        shown = flag if f.switch else f"{flag} {value}"
        if f.status == "alias":
            _alias(args, f, flag, value, warnings)
        elif f.status == "warn":
            warnings.append(f"{shown} changes nothing here: {f.why}")
        elif f.status == "pending":
            warnings.append(f"{shown} is accepted but not active in this build ({f.why})")
        elif f.status == "one":
            if _int(flag, value) != 1:
                raise ValueError(f"{shown}: {f.why}")
            warnings.append(f"{shown} changes nothing here: 1 is what k2serve runs")
        else:  # refuse
            raise ValueError(f"{flag} is not supported: {f.why}")
    for w in warnings:
        logger.warning("%s", w)
    return warnings


def _alias(args, f: GuideFlag, flag: str, value, warnings: list[str]) -> None:
    dest = f.target.lstrip("-").replace("-", "_")
    if f.convert == "off":  # --disable-X = --no-enable-X
        setattr(args, dest.removeprefix("no_"), False)
    elif f.switch:
        setattr(args, dest, True)
    elif f.convert == "ep_size":
        n, tp = _int(flag, value), args.tensor_parallel_size
        if n not in (1, tp):
            raise ValueError(
                f"{flag} {n}: expert parallelism spans the tensor-parallel ranks "
                f"(--tensor-parallel-size {tp}); give {flag} {tp} or --enable-expert-parallel"
            )
        args.enable_expert_parallel = n > 1
    elif f.convert == "chunked_prefill":
        n = _int(flag, value)
        if n == -1:  # SGLang: chunked prefill off
            args.enable_chunked_prefill = False
        else:
            args.max_num_batched_tokens = n
    elif f.convert == "tokens_to_pages":
        page = args.page_size
        args.num_kv_pages = -(-_int(flag, value) // page)
    elif f.convert == "cpu_threads":
        n = _int(flag, value)
        if n < 1:
            raise ValueError(f"{flag} {n} must be >= 1")
        os.environ["K2SERVE_CPU_THREADS"] = str(n)  # read by the CPU kernel (workers inherit)
    elif f.convert == "numa_nodes":
        args.guide_numa_nodes = _int(flag, value)  # checked against the machine at start-up
    else:
        typ = {"model": str, "gpu_memory_utilization": float}.get(dest, int)
        try:
            setattr(args, dest, typ(value))
        except ValueError:
            raise ValueError(f"{flag} {value!r}: expected a {typ.__name__}") from None


def env_warnings(environ=None) -> list[str]:
    """One line per guide environment variable that is set and changes nothing here."""
    environ = os.environ if environ is None else environ
    return [
        f"{name} is set and changes nothing here: {why}"
        for name, status, why in ENV_VARS
        if status == "warn" and name in environ
    ]


def render_markdown() -> str:
    """docs/flags.md, generated from the table (the test checks the file is current)."""
    out = [
        "# Flags of the deployment guides",
        "",
        "Generated from `src/k2serve/server/guide_flags.py` by "
        "`python -m k2serve.server.guide_args > docs/flags.md`; "
        "tests/server/test_guide_flags.py walks the same table.",
        "",
        "Statuses: **implemented** (same name), **alias** (another spelling of a k2serve flag), "
        "**warn** (accepted, one warning line: it changes nothing here), **one** (value 1 "
        "accepted, other values refused), **refuse** (the server does not start; the message "
        "names the k2serve equivalent), **pending** (accepted, not active in this build).",
        "",
        "| flag | from | status | k2serve |",
        "|---|---|---|---|",
    ]
    for f in ALL_FLAGS:
        what = f.target if f.status in ("implemented", "alias") else f.why
        out.append(f"| `{'`, `'.join(f.spellings)}` | {f.source} | {f.status} | {what} |")
    out += [
        "",
        "Value spellings: `--kv-cache-dtype fp8_e4m3` (and `float8_e4m3fn`) = `fp8`; "
        "`--load-format compressed-tensors` reads safetensors (INT4 is read from config.json); "
        "`--chunked-prefill-size -1` turns chunked prefill off; `--max-total-tokens T` = "
        "`--num-kv-pages ceil(T / page size)`.",
        "",
        "Machine checks at start-up: tensor / expert parallelism and GPU expert flags without a "
        "GPU are errors unless `--device cpu` is given; `--gpu-memory-utilization` and "
        "`--enforce-eager` with `--device cpu` log that they do nothing; CPU threads "
        "(`--kt-cpuinfer`, K2SERVE_CPU_THREADS) and NUMA topologies beyond the machine are "
        "errors; the chosen threads, NUMA nodes and expert placement are logged.",
        "",
        "## Environment variables",
        "",
        "| variable | status | what k2serve does |",
        "|---|---|---|",
    ]
    out += [f"| `{n}` | {s} | {w} |" for n, s, w in ENV_VARS]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
