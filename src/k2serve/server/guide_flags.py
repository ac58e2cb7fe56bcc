"""Every flag and environment variable of the deployment guides (vLLM, SGLang, KTransformers /
KT-Kernel) and what `k2serve serve` does with it: the one table that the parser
(`k2serve.server.guide_args`), docs/flags.md (`guide_args.render_markdown`) and
tests/server/test_guide_flags.py read. Data only.

Statuses:
- implemented: k2serve has the flag under the same name (`target`).
- alias: another spelling of the k2serve flag `target` (a `convert` names a value mapping).
- warn: accepted; one warning line says why it changes nothing here (`why`).
- refuse: the server does not start; the message names the k2serve equivalent (`why`).
- one: accepted when its value is 1 (what k2serve does anyway), refused otherwise (`why`).
- pending: built on another branch; accepted here with a warning that it is not active in this
  build. PENDING is the one place to edit when those features are merged: a flag the parser
  already defines is never added again, so a merged implementation takes over by itself.

Flags whose meaning depends on the machine (GPU-only flags on the CPU) are checked in
`k2serve.server.startup`, which logs what they did.
"""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("implemented", "alias", "warn", "refuse", "one", "pending")


@dataclass(frozen=True)
class GuideFlag:
    spellings: tuple[str, ...]  # as the guides write them; the first is the main one
    status: str
    source: str  # vLLM, SGLang, KT-Kernel (SGLang + kt-kernel)
    target: str = ""  # implemented / alias: the k2serve flag (or K2SERVE_* variable)
    why: str = ""  # warn / refuse / one / pending: the reason, naming what to use instead
    switch: bool = False  # takes no value
    example: str = "1"  # a value for the test that walks the table
    convert: str = ""  # alias: how the value maps (k2serve.server.guide_args._alias)
    nargs: str | None = None  # "+": several values, as the guide's engine takes them

    @property
    def dest(self) -> str:
        return "guide_" + self.spellings[0].lstrip("-").replace("-", "_")


_INT4 = "the format (INT4 compressed-tensors, FP8 block, bf16) is read from config.json"
_DP = "k2serve starts one process per data-parallel rank itself (--data-parallel-size)"
_GPU_EXPERTS = "use --num-gpu-experts N (routed experts per MoE layer on the GPU)"


def _w(src: str, flags: str, why: str, ex: str = "1", switch: bool = False) -> GuideFlag:
    return GuideFlag(tuple(flags.split()), "warn", src, why=why, example=ex, switch=switch)


def _a(src: str, flags: str, target: str, ex: str = "1", **kw) -> GuideFlag:
    return GuideFlag(tuple(flags.split()), "alias", src, target=target, example=ex, **kw)


def _r(src: str, flags: str, why: str, ex: str = "1", switch: bool = False) -> GuideFlag:
    return GuideFlag(tuple(flags.split()), "refuse", src, why=why, example=ex, switch=switch)


FLAGS: tuple[GuideFlag, ...] = (
    # ---- vLLM: implemented under the same name -----------------------------------------------
    *(
        GuideFlag((f,), "implemented", "vLLM", target=f, switch=s, example=e)
        for f, s, e in (
            ("--model", False, "/m"),
            ("--served-model-name", False, "kimi-k2"),
            ("--host", False, "0.0.0.0"),
            ("--port", False, "8001"),
            ("--tensor-parallel-size", False, "1"),
            ("--enable-expert-parallel", True, ""),
            ("--max-model-len", False, "8192"),
            ("--max-num-seqs", False, "32"),
            ("--max-num-batched-tokens", False, "8192"),
            ("--gpu-memory-utilization", False, "0.9"),
            ("--kv-cache-dtype", False, "fp8"),
            ("--enable-prefix-caching", True, ""),
            ("--enable-chunked-prefill", True, ""),
            ("--enforce-eager", True, ""),
            ("--async-scheduling", True, ""),
            ("--no-async-scheduling", True, ""),
            ("--stream-interval", False, "2"),  # also SGLang's spelling
            ("--dtype", False, "bfloat16"),
            ("--load-format", False, "auto"),
            ("--trust-remote-code", True, ""),
            ("--tool-call-parser", False, "kimi_k2"),
            ("--reasoning-parser", False, "kimi_k2"),
            ("--enable-auto-tool-choice", True, ""),
            ("--chat-template", False, "{{ messages }}"),
            ("--api-key", False, "k"),
            ("--seed", False, "0"),
            ("--block-size", False, "16"),
            ("--generation-config", False, "auto"),
            ("--nnodes", False, "1"),
            ("--node-rank", False, "0"),
            ("--master-addr", False, "127.0.0.1"),
            ("--master-port", False, "29500"),
            ("--headless", True, ""),
            # data parallel attention + expert-parallel MoE, EPLB (issue 29)
            ("--data-parallel-size", False, "1"),
            ("--data-parallel-size-local", False, "1"),
            ("--data-parallel-address", False, "127.0.0.1"),
            ("--data-parallel-rpc-port", False, "13345"),
            ("--data-parallel-start-rank", False, "0"),
            ("--enable-eplb", True, ""),
            ("--eplb-config", False, '{"window_size": 1000}'),
            ("--skip-non-local-expert-weights", True, ""),
        )
    ),
    *(
        GuideFlag((short,), "implemented", "vLLM", target=long)
        for short, long in (
            ("-dp", "--data-parallel-size"),
            ("-dpl", "--data-parallel-size-local"),
            ("-dpr", "--data-parallel-start-rank"),
        )
    ),
    GuideFlag(
        ("--enable-dp-attention",),
        "implemented",
        "SGLang",
        target="--enable-dp-attention",
        switch=True,
    ),
    GuideFlag(("-tp",), "implemented", "vLLM", target="--tensor-parallel-size"),
    # ---- vLLM: accepted, nothing to change here ----------------------------------------------
    _w("vLLM", "--quantization -q", _INT4, "fp8"),
    _w(
        "vLLM",
        "--tokenizer-mode",
        "k2serve always uses the checkpoint's tiktoken tokenizer",
        "auto",
    ),
    _w(
        "vLLM",
        "--quantization-param-path",
        "k2serve's fp8 KV cache needs no scaling-factor file",
        "scales.json",
    ),
    _w(
        "vLLM",
        "--enable-reasoning",
        "reasoning is split by --reasoning-parser kimi_k2, which is always on",
        switch=True,
    ),
    _w(
        "vLLM",
        "--enable-log-requests --disable-log-stats",
        "k2serve never logs request contents; statistics are on /metrics",
        switch=True,
    ),
    *(
        GuideFlag((f,), "implemented", "vLLM", target="--disable-access-log", switch=True)
        for f in ("--disable-log-requests", "--disable-uvicorn-access-log")
    ),
    _w(
        "vLLM",
        "--distributed-executor-backend",
        "k2serve starts its own worker processes (one per GPU); no Ray",
        "mp",
    ),
    _w(
        "vLLM",
        "--compilation-config -O",
        "no torch.compile; CUDA graphs are captured unless --enforce-eager",
        "{}",
    ),
    GuideFlag(("--tokenizer",), "implemented", "vLLM", target="--tokenizer", example="/m"),
    # ---- vLLM: limited to 1, refused --------------------------------------------------------
    _w("vLLM", "--data-parallel-backend -dpb", _DP, "mp"),
    _w("vLLM", "--data-parallel-hybrid-lb", _DP, switch=True),
    GuideFlag(
        ("--pipeline-parallel-size", "-pp"),
        "one",
        "vLLM",
        why="pipeline parallelism is not built; spread tensor parallelism over nodes "
        "with --tensor-parallel-size N --nnodes M --node-rank R",
    ),
    GuideFlag(
        ("--decode-context-parallel-size", "-dcp"),
        "one",
        "vLLM",
        why="decode context parallelism is not built: every TP rank holds the whole "
        "latent cache; use --kv-cache-dtype fp8 for twice the tokens",
    ),
    _r(
        "vLLM",
        "--cpu-offload-gb",
        "k2serve offloads whole experts, not bytes: " + _GPU_EXPERTS,
        "100",
    ),
    # ---- SGLang spellings -------------------------------------------------------------------
    _a("SGLang", "--model-path", "--model", "/m"),
    _a("SGLang", "--tp --tp-size", "--tensor-parallel-size"),
    _a("SGLang", "--dp-size --dp", "--data-parallel-size"),
    _a("SGLang", "--ep-size --ep", "--enable-expert-parallel", convert="ep_size"),
    _a("SGLang", "--context-length", "--max-model-len", "8192"),
    _a("SGLang", "--mem-fraction-static", "--gpu-memory-utilization", "0.85"),
    _a(
        "SGLang",
        "--chunked-prefill-size",
        "--max-num-batched-tokens",
        "8192",
        convert="chunked_prefill",
    ),
    _a("SGLang", "--max-running-requests", "--max-num-seqs", "32"),
    _a("SGLang", "--max-total-tokens", "--num-kv-pages", "65536", convert="tokens_to_pages"),
    _a("SGLang", "--disable-cuda-graph", "--enforce-eager", switch=True),
    GuideFlag(
        ("--dist-init-addr",),
        "implemented",
        "SGLang",
        target="--dist-init-addr",
        example="10.0.0.1:5000",
    ),
    _w("SGLang", "--cuda-graph-max-bs", "decode graphs are captured up to --max-num-seqs", "64"),
    _w(
        "SGLang",
        "--moe-a2a-backend",
        "expert parallelism here combines experts with one all-reduce",
        "deepep",
    ),
    _w(
        "SGLang",
        "--enable-mixed-chunk",
        "always so: prefill chunks and decodes share each step",
        switch=True,
    ),
    _w(
        "SGLang",
        "--watchdog-timeout",
        "collective timeouts come from K2SERVE_DIST_TIMEOUT_S",
        "1000",
    ),
    *(
        GuideFlag(
            (f,),
            "refuse",
            "SGLang",
            example="EAGLE3",
            why="speculative decoding is configured with --speculative-config JSON",
        )
        for f in (
            "--speculative-algorithm",
            "--speculative-draft-model-path",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
        )
    ),
    # ---- KTransformers / KT-Kernel (SGLang + kt-kernel) -------------------------------------
    _a("KT-Kernel", "--kt-num-gpu-experts", "--num-gpu-experts", "8"),
    _a("KT-Kernel", "--kt-cpuinfer", "K2SERVE_CPU_THREADS", convert="cpu_threads"),
    _a("KT-Kernel", "--kt-threadpool-count", "(NUMA nodes)", convert="numa_nodes"),
    _a("KT-Kernel", "--kt-gpu-prefill-token-threshold", "--gpu-prefill-token-threshold", "4096"),
    _a("KT-Kernel", "--kt-enable-dynamic-expert-update", "--dynamic-expert-placement", switch=True),
    _w(
        "KT-Kernel",
        "--kt-method",
        _INT4 + "; the CPU kernel follows it (K2SERVE_CPU_KERNEL picks native / torch)",
        "RAWINT4",
    ),
    _w(
        "KT-Kernel",
        "--kt-weight-path",
        "the CPU experts are read from the --model checkpoint itself",
        "/m",
    ),
    _w(
        "KT-Kernel",
        "--kt-amx-weight-path",
        "the CPU experts are read from the --model checkpoint itself",
        "/m",
    ),
    _w(
        "KT-Kernel",
        "--kt-max-deferred-experts-per-token",
        "expert deferral is not built: every routed expert is computed in its layer "
        "(exact outputs)",
        "2",
    ),
    _w(
        "KT-Kernel",
        "--kt-expert-placement-strategy",
        "the GPU gets experts 0..N-1, or the most-routed ones with --expert-placement-file "
        "(written by --record-routing)",
        "frequency",
    ),
    _r(
        "KT-Kernel",
        "--kt-gpu-experts-ratio",
        _GPU_EXPERTS + ", e.g. ratio 0.1 of 384 = --num-gpu-experts 38",
        "0.1",
    ),
    _r(
        "KT-Kernel",
        "--init-expert-location",
        "use --expert-placement-file COUNTS.json (the file --record-routing writes)",
        "stats.pt",
    ),
    _r("llama.cpp", "--n-cpu-moe --cpu-moe", _GPU_EXPERTS, "30"),
)


_ONE_AR = "one all-reduce combines the experts of all ranks"
_XGR = "structured outputs always use xgrammar"
_KT_DIR = "the CPU experts are read from the --model checkpoint itself"
_THINK = "thinking follows the chat template; off with --default-chat-template-kwargs "
MORE_FLAGS: tuple[GuideFlag, ...] = (
    # vLLM
    _w("vLLM", "--all2all-backend", _ONE_AR, "deepep_low_latency"),
    _w("vLLM", "--disable-custom-all-reduce", "all-reduces are torch.distributed's", switch=True),
    _w("vLLM", "--max-log-len", "k2serve never logs prompts", "100"),
    _w("vLLM", "--enable-prompt-tokens-details", "usage reports prompt tokens", switch=True),
    _w("vLLM", "--guided-decoding-backend --structured-outputs-config", _XGR, "xgrammar"),
    _w("vLLM", "--mm-processor-cache-gb --media-io-kwargs", "for images (the vision encoder)", "4"),
    _w("vLLM", "--safetensors-load-strategy", "shards are read tensor by tensor", "lazy"),
    _r(
        "vLLM",
        "--download-dir --revision",
        "serve reads a local directory: fetch it first "
        "with k2serve download MODEL --dir DIR [--revision REV]",
        "/data",
    ),
    _r("vLLM", "--hf-overrides", "edit the checkpoint's config.json", "{}"),
    _r(
        "vLLM",
        "--override-generation-config",
        "use --generation-config DIR (a directory with a generation_config.json)",
        "{}",
    ),
    # SGLang
    _a("SGLang", "--disable-radix-cache", "--no-enable-prefix-caching", convert="off", switch=True),
    _w("SGLang", "--deepep-mode", _ONE_AR, "auto"),
    GuideFlag(
        ("--cuda-graph-bs",),
        "warn",
        "SGLang",
        nargs="+",
        example="8",
        why="decode graphs are captured up to --max-num-seqs",
    ),
    _w(
        "SGLang",
        "--disable-shared-experts-fusion --enable-p2p-check",
        "k2serve has no such switch (its kernels are fixed per format)",
        switch=True,
    ),
    _w(
        "SGLang",
        "--enable-torch-compile",
        "no torch.compile; CUDA graphs unless --enforce-eager",
        switch=True,
    ),
    _w("SGLang", "--grammar-backend", _XGR, "xgrammar"),
    _w("SGLang", "--fp8-gemm-backend", "FP8 GEMMs are k2serve's Triton kernels", "triton"),
    # KT-Kernel / KTransformers (older spellings included)
    _a("KT-Kernel", "--cpuinfer", "K2SERVE_CPU_THREADS", convert="cpu_threads"),
    _a("KT-Kernel", "--threadpool-count", "(NUMA nodes)", convert="numa_nodes"),
    _w("KT-Kernel", "--kt-amx-method --amx-method", _INT4, "AMXINT4"),
    _w("KT-Kernel", "--amx-weight-path", _KT_DIR, "/m"),
    _a("KTransformers", "--model_path", "--model", "/m"),
    _a("KTransformers", "--cpu_infer", "K2SERVE_CPU_THREADS", convert="cpu_threads"),
    _a("KTransformers", "--cache_lens", "--num-kv-pages", "65536", convert="tokens_to_pages"),
    _a("KTransformers", "--max_batch_size", "--max-num-seqs", "8"),
    _a("KTransformers", "--chunk_size", "--max-num-batched-tokens", "8192"),
    _r(
        "KTransformers",
        "--gguf_path",
        "GGUF is not read: serve the Hugging Face safetensors "
        "checkpoint (INT4 / FP8 / bf16) with --model DIR",
        "/g",
    ),
    _w("KTransformers", "--optimize_config_path", "placement comes from --num-gpu-experts", "x"),
    _w("KTransformers", "--max_new_tokens", "each request's max_tokens sets it", "512"),
    _w("KTransformers", "--force_think", _THINK + "'{\"thinking\": false}'", switch=True),
    _w(
        "KTransformers",
        "--use_cuda_graph",
        "CUDA graphs are on unless --enforce-eager",
        switch=True,
    ),
    _w("KTransformers", "--backend_type", "one engine, k2serve's", "balance_serve"),
    _w("KTransformers", "--web", "the OpenAI API is served; no web UI", switch=True),
)

# Built on other branches (speculative decoding, host KV tier, vision): accepted, inactive here.
# Flags of the features built beside this table (host KV tier, speculative decoding, vision):
# the parser defines them itself.
FEATURE_FLAGS: tuple[GuideFlag, ...] = tuple(
    GuideFlag((f,), "implemented", "vLLM", target=f, example=ex)
    for f, ex in (
        ("--swap-space", "16"),
        ("--kv-offloading-size", "64"),
        ("--kv-offloading-backend", "native"),
        ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
        ("--mm-encoder-tp-mode", "data"),
        ("--limit-mm-per-prompt", '{"image": 2}'),
        ("--allowed-media-domains", "example.com"),
        ("--allowed-local-media-path", "/data"),
    )
)
PENDING: tuple[GuideFlag, ...] = ()  # none: every feature flag is built

ALL_FLAGS = FLAGS + MORE_FLAGS + FEATURE_FLAGS + PENDING

# Environment variables of the guides: (name, status, what k2serve does with it).
ENV_VARS: tuple[tuple[str, str, str], ...] = (
    ("CUDA_VISIBLE_DEVICES", "implemented", "the GPUs torch sees"),
    ("HF_HOME", "implemented", "`k2serve download`'s cache (huggingface_hub)"),
    ("HF_TOKEN", "implemented", "`k2serve download` for gated repositories"),
    ("HF_HUB_OFFLINE", "implemented", "`k2serve download` refuses to start (needs the network)"),
    ("NCCL_SOCKET_IFNAME", "implemented", "read by NCCL (tensor parallel across nodes)"),
    ("NCCL_IB_DISABLE", "implemented", "read by NCCL"),
    ("GLOO_SOCKET_IFNAME", "implemented", "read by gloo (CPU ranks, node handshake)"),
    (
        "OMP_NUM_THREADS",
        "implemented",
        "torch's CPU threads (the CPU experts use K2SERVE_CPU_THREADS or --kt-cpuinfer)",
    ),
    ("VLLM_USE_DEEP_GEMM", "warn", "k2serve's FP8 GEMMs are its own Triton kernels"),
    ("VLLM_ATTENTION_BACKEND", "warn", "use --attention-backend auto|torch|triton"),
    ("VLLM_ALL2ALL_BACKEND", "warn", "expert parallelism combines with one all-reduce"),
    ("VLLM_USE_FLASHINFER_MOE_FP8", "warn", "use --moe-backend auto|torch|triton"),
    ("VLLM_WORKER_MULTIPROC_METHOD", "warn", "workers always start with spawn"),
    ("VLLM_HOST_IP", "warn", "use --master-addr"),
    ("SGLANG_ENABLE_JIT_DEEPGEMM", "warn", "k2serve's FP8 GEMMs are its own Triton kernels"),
    ("SGL_ENABLE_JIT_DEEPGEMM", "warn", "k2serve's FP8 GEMMs are its own Triton kernels"),
    ("VLLM_USE_V1", "warn", "k2serve has one engine"),
    ("VLLM_MLA_DISABLE", "warn", "MLA is always absorbed for decode"),
    ("PYTORCH_CUDA_ALLOC_CONF", "implemented", "read by torch's CUDA allocator"),
    (
        "USE_NUMA",
        "warn",
        "the CPU experts always group threads by NUMA node "
        "(K2SERVE_NUMA_TOPOLOGY overrides the topology)",
    ),
)
