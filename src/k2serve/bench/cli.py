"""`k2serve bench`: flags (named as in `vllm bench serve` where the meaning agrees) and dispatch.

Subcommands: none = run a serving benchmark; `compare A.json B.json` = side-by-side table.
`SUBCOMMANDS` maps further names to modules with `add_arguments` / `run` (the name `model` is
reserved for a GPU model benchmark living in its own module).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

# name -> (module, help). NOTE: "model" is reserved for `k2serve bench model` (GPU benchmark).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("k2serve.bench.compare_cli", "side-by-side table of two result JSON files"),
}
DATASETS = {"random": "random", "sharegpt": "sharegpt", "jsonl": "jsonl", "custom": "jsonl"}
DATASETS |= {"hf": "hf"}  # vLLM's hub datasets, read here from a local file (no hub access)
DATASETS |= {"prefix": "prefix", "prefix_repetition": "prefix"}
DATASETS |= {"vision": "vision", "sharegpt4v": "vision", "visionarena": "vision"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    for name, (module, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).add_arguments(sp)

    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (or .../v1)")
    g.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    g.add_argument(
        "--api",
        choices=["chat", "completions"],
        default=None,
        help="OpenAI API to call (default chat)",
    )
    g.add_argument(
        "--backend",
        choices=["openai", "openai-chat", "vllm"],
        default=None,
        help="vLLM spelling of --api: openai/vllm = completions, openai-chat = chat",
    )
    g.add_argument(
        "--endpoint",
        default=None,
        help="path under the base URL (default /v1/chat/completions or /v1/completions)",
    )
    g.add_argument(
        "--model", default=None, help="model name to send (default: first of /v1/models)"
    )
    g.add_argument("--served-model-name", default=None, help="overrides --model in requests")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take in all (connect + whole stream)",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=sorted(DATASETS),
        help="random | sharegpt | jsonl (alias custom) | prefix (alias prefix_repetition) | "
        "hf (a local copy of a hub dataset: ShareGPT or VisionArena records, JSON or JSONL) | "
        "vision (aliases sharegpt4v, visionarena: records with images)",
    )
    g.add_argument("--dataset-path", default=None, help="file for sharegpt / jsonl / hf / vision")
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for `vllm bench serve` command lines; k2serve bench runs no model code "
        "(token counts come from the server)",
    )
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="instead of a count: release requests for this many seconds, cycling",
    )
    g.add_argument("--random-input-len", type=int, default=1024, help="words (~tokens)")
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1)",
    )
    g.add_argument(
        "--calibrate-input-len",
        action="store_true",
        help="random/prefix: ask the server (2 probes) how many tokens a word is, and size "
        "prompts in the server's tokens instead of words",
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random: words of one prefix shared by every prompt",
    )
    g.add_argument(
        "--prefix-len",
        "--prefix-repetition-prefix-len",
        dest="prefix_len",
        type=int,
        default=256,
        help="prefix: words of each shared prefix",
    )
    g.add_argument(
        "--prefix-share-ratio",
        type=float,
        default=1.0,
        help="prefix: fraction of requests that reuse a shared prefix",
    )
    g.add_argument(
        "--prefix-num-prefixes",
        "--prefix-repetition-num-prefixes",
        dest="prefix_num_prefixes",
        type=int,
        default=1,
        help="prefix: distinct shared prefixes",
    )
    g.add_argument(
        "--output-len",
        "--sharegpt-output-len",
        "--custom-output-len",
        dest="output_len",
        type=int,
        default=None,
        help="sharegpt/jsonl: max_tokens for every request (default: per record)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--random-images-per-prompt",
        type=int,
        default=0,
        help="random/prefix (--api chat): synthetic images sent with each prompt (K2.5)",
    )
    g.add_argument(
        "--random-image-size",
        nargs="+",
        default=["1024x1024"],
        help="WxH of the synthetic images, cycled (default 1024x1024)",
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson arrivals (inf = all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps (1 = Poisson)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")

    g = p.add_argument_group("sampling (sent as given)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request")

    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs, e.g. ttft:500 tpot:50 e2el:10000",
    )
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument(
        "--save-result",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the JSON result and PNG plot",
    )
    g.add_argument("--result-dir", default=".", help="directory for the result files")
    g.add_argument("--result-filename", default=None, help="JSON file name (PNG: same stem)")
    g.add_argument("--label", default="k2serve-bench", help="prefix of the default file name")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _join(base: str, path: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + path


def _base_url(args: argparse.Namespace) -> str:
    base = args.base_url or f"http://{args.host}:{args.port}"
    u = urlsplit(base)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"--base-url {base!r}: expected http(s)://host[:port][/prefix]")
    return base


def _api(args: argparse.Namespace) -> str:
    if args.api and args.backend:
        if {"openai-chat": "chat"}.get(args.backend, "completions") != args.api:
            raise ValueError(f"--api {args.api} contradicts --backend {args.backend}")
    if args.api:
        return args.api
    # --backend is one of these (argparse choices)
    return {"openai-chat": "chat", "openai": "completions", "vllm": "completions"}[
        args.backend or "openai-chat"
    ]


def _discover_model(base: str, api_key: str | None, timeout: float) -> str:
    import httpx

    url = _join(base, "/v1/models")
    h = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=h, timeout=min(timeout, 30.0), trust_env=False)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ConnectionError(f"GET {url} -> HTTP {r.status_code}: {r.text[:200]}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConnectionError(f"GET {url}: no model listed; pass --model") from None


def _samples(args: argparse.Namespace):
    from k2serve.bench import datasets as ds

    name = DATASETS[args.dataset_name]
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    n = args.num_prompts
    if name in ("sharegpt", "jsonl", "hf", "vision") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if name == "vision":
        from k2serve.bench.images import vision_dataset

        return vision_dataset(args.dataset_path, n, args.output_len, args.seed)
    if name in ("random", "prefix") and args.random_images_per_prompt > 0:
        from k2serve.bench.images import parse_size, with_synthetic_images

        sizes = [parse_size(s) for s in args.random_image_size]
        text_args = argparse.Namespace(**{**vars(args), "random_images_per_prompt": 0})
        return with_synthetic_images(
            _samples(text_args), sizes, args.random_images_per_prompt, args.seed
        )
    if name == "random":
        return ds.random_dataset(
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    if name == "prefix":
        return ds.prefix_dataset(
            n,
            args.prefix_len,
            args.random_input_len,
            args.random_output_len,
            args.prefix_share_ratio,
            args.prefix_num_prefixes,
            args.random_range_ratio,
            args.seed,
        )
    if name == "sharegpt":
        return ds.sharegpt_dataset(args.dataset_path, n, args.output_len, args.seed)
    if name == "hf":
        # VisionArena / ShareGPT-4V records carry images: send them, as `vllm bench` does
        if _has_images(args.dataset_path):
            from k2serve.bench.images import vision_dataset

            return vision_dataset(args.dataset_path, n, args.output_len, args.seed)
        return ds.hf_dataset(args.dataset_path, n, args.output_len, args.seed)
    return ds.jsonl_dataset(args.dataset_path, n, args.output_len)


def _has_images(path: str) -> bool:
    """Whether the first record of a local dataset file names images (`images` / `image`)."""
    from k2serve.bench import datasets as ds

    try:
        for _, rec in ds._read_records(Path(path)):
            return isinstance(rec, dict) and rec.get("images", rec.get("image")) is not None
    except (ds.DatasetError, OSError, ValueError):
        return False
    return False


def _result_path(args: argparse.Namespace, api: str, model: str) -> Path:
    if args.result_filename:
        return Path(args.result_dir) / args.result_filename
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    conc = f"-c{args.max_concurrency}" if args.max_concurrency else ""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    return Path(args.result_dir) / f"{args.label}-{api}-{rate}qps{conc}-{safe_model}-{stamp}.json"


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args`; print the table; return the result document."""
    from k2serve import __version__
    from k2serve.bench import metrics, report
    from k2serve.bench.client import RequestSpec
    from k2serve.bench.runner import LoadSpec, run

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    base, api = _base_url(args), _api(args)
    percentiles = metrics.parse_percentiles(args.metric_percentiles)
    slos = metrics.parse_goodput(args.goodput)
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    load = LoadSpec(
        args.request_rate,
        args.burstiness,
        args.max_concurrency,
        args.num_warmups,
        args.duration,
        args.seed,
        progress=not args.disable_tqdm,
    )
    load.validate()
    if args.calibrate_input_len and DATASETS[args.dataset_name] not in ("random", "prefix"):
        raise ValueError("--calibrate-input-len applies to --dataset-name random or prefix")
    samples = _samples(args)  # validates the workload flags before any request is sent
    model = args.served_model_name or args.model
    if not model:
        model = _discover_model(base, args.api_key, args.request_timeout)
    if api == "completions" and any(not isinstance(s.prompt, str) for s in samples):
        raise ValueError("the workload has chat messages: use --api chat")
    endpoint = args.endpoint or ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    sampling = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("top_k", args.top_k),
        )
        if v is not None
    }
    spec = RequestSpec(
        _join(base, endpoint),
        api,
        model,
        args.api_key,
        args.ignore_eos,
        sampling,
        extra,
        args.request_timeout,
        _join(base, "/v1/models"),
    )

    cal = None
    if args.calibrate_input_len:
        from k2serve.bench.calibrate import calibrate

        cal = calibrate(spec, args.seed)
        args = argparse.Namespace(**vars(args))
        args.random_input_len = cal.words_for(args.random_input_len)
        if args.random_prefix_len:
            args.random_prefix_len = cal.words_for(args.random_prefix_len, with_overhead=False)
        args.prefix_len = cal.words_for(args.prefix_len, with_overhead=False)
        print(
            f"calibration: {cal.tokens_per_word:.3f} tokens/word + {cal.overhead_tokens:.1f} "
            f"per request -> {args.random_input_len} words per prompt"
        )
        samples = _samples(args)

    result = run(spec, samples, load)
    res = metrics.summarize(result.outcomes, result.duration_s, percentiles, slos)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    res["config"] = {
        "url": spec.url,
        "api": api,
        "model": model,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "duration": args.duration,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "prefix_len": args.prefix_len,
        "prefix_share_ratio": args.prefix_share_ratio,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "warmups_failed": sum(not o.success for o in result.warmup_outcomes),
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "sampling": sampling,
        "k2serve_version": __version__,
        "calibration": None
        if cal is None
        else {"tokens_per_word": cal.tokens_per_word, "overhead_tokens": cal.overhead_tokens},
    }
    # vLLM result-file keys, so tools reading those files read ours.
    res.update(
        date=_dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend=api,
        model_id=model,
        num_prompts=len(result.outcomes),
        request_rate=rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
    )
    print(report.format_table(res))
    if args.save_result:
        path = _result_path(args, api, model)
        report.write_result(path, res, result.outcomes)
        print(f"result: {path}")
        if not args.no_plot:
            from k2serve.bench.plot import plot_run

            title = f"{model} @ {spec.url}  rate={rate} concurrency={args.max_concurrency}"
            png = plot_run(path.with_suffix(".png"), result.outcomes, result.duration_s, title)
            print(f"plot:   {png}")
    return res


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "bench_command", None)
    if cmd:
        return int(importlib.import_module(SUBCOMMANDS[cmd][0]).run(args) or 0)
    if getattr(args, "trust_remote_code", False):
        print("k2serve bench: --trust-remote-code changes nothing here: no model code runs on "
              "the client (token counts come from the server)", file=sys.stderr)  # fmt: skip
    try:
        res = run_benchmark(args)
    except (ValueError, ConnectionError, FileNotFoundError) as e:
        print(f"k2serve bench: error: {e}", file=sys.stderr)
        return 2
    return 0 if res["completed"] > 0 else 1
