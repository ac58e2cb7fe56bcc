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
    convert: str = ""  # alias: the name of a value mapping in `_CONVERT`

    @property
    def dest(self) -> str:
        return "guide_" + self.spellings[0].lstrip("-").replace("-", "_")


_INT4 = "the format (INT4 compressed-tensors, FP8 block, bf16) is read from config.json"
_DP = "data parallelism is not built yet: k2serve runs one engine (tensor parallel)"
_DP_EQ = "; use --tensor-parallel-size N (and --nnodes / --node-rank across nodes)"
_GPU_EXPERTS = "use --num-gpu-experts N (routed experts per MoE layer on the GPU)"

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
        )
    ),
    GuideFlag(("-tp",), "implemented", "vLLM", target="--tensor-parallel-size"),
    # ---- vLLM: accepted, nothing to change here ----------------------------------------------
    GuideFlag(("--quantization", "-q"), "warn", "vLLM", why=_INT4, example="fp8"),
    GuideFlag(
        ("--tokenizer-mode",),
        "warn",
        "vLLM",
        why="k2serve always uses the checkpoint's tiktoken tokenizer",
        example="auto",
    ),
    GuideFlag(
        ("--skip-non-local-expert-weights",),
        "warn",
        "vLLM",
        switch=True,
        why="always so: each expert-parallel rank reads only its own experts",
    ),
    GuideFlag(
        ("--quantization-param-path",),
        "warn",
        "vLLM",
        example="scales.json",
        why="k2serve's fp8 KV cache needs no scaling-factor file",
    ),
    GuideFlag(
        ("--no-async-scheduling", "--async-scheduling"),
        "warn",
        "vLLM",
        switch=True,
        why="k2serve schedules each step after the previous one; there is no switch",
    ),
    GuideFlag(
        ("--enable-reasoning",),
        "warn",
        "vLLM",
        switch=True,
        why="reasoning is split by --reasoning-parser kimi_k2, which is always on",
    ),
    GuideFlag(
        ("--disable-log-requests", "--enable-log-requests", "--disable-log-stats"),
        "warn",
        "vLLM",
        switch=True,
        why="k2serve never logs request contents; statistics are on /metrics",
    ),
    GuideFlag(
        ("--disable-uvicorn-access-log",),
        "warn",
        "vLLM",
        switch=True,
        why="the access log is always off",
    ),
    GuideFlag(
        ("--distributed-executor-backend",),
        "warn",
        "vLLM",
        example="mp",
        why="k2serve starts its own worker processes (one per GPU); no Ray",
    ),
    GuideFlag(
        ("--compilation-config", "-O"),
        "warn",
        "vLLM",
        example="{}",
        why="no torch.compile; CUDA graphs are captured unless --enforce-eager",
    ),
    GuideFlag(
        ("--enable-eplb",),
        "warn",
        "vLLM",
        switch=True,
        why="expert load balancing is not built; with experts in host RAM, "
        "--dynamic-expert-placement moves the most-routed ones to the GPU",
    ),
    GuideFlag(
        ("--eplb-config",),
        "warn",
        "vLLM",
        example="{}",
        why="expert load balancing is not built (see --enable-eplb)",
    ),
    GuideFlag(("--tokenizer",), "implemented", "vLLM", target="--tokenizer", example="/m"),
    # ---- vLLM: limited to 1, refused --------------------------------------------------------
    GuideFlag(("--data-parallel-size", "-dp"), "one", "vLLM", why=_DP + _DP_EQ),
    GuideFlag(("--data-parallel-size-local", "-dpl"), "one", "vLLM", why=_DP + _DP_EQ),
    GuideFlag(
        ("--data-parallel-start-rank", "-dpr"),
        "warn",
        "vLLM",
        example="0",
        why=_DP + " (one engine, so no data-parallel ranks)",
    ),
    GuideFlag(
        ("--data-parallel-address", "-dpa"),
        "warn",
        "vLLM",
        example="10.0.0.1",
        why=_DP + "; node 0's address is --master-addr",
    ),
    GuideFlag(
        ("--data-parallel-rpc-port", "-dpp"),
        "warn",
        "vLLM",
        example="13345",
        why=_DP + "; node 0's port is --master-port",
    ),
    GuideFlag(("--data-parallel-backend", "-dpb"), "warn", "vLLM", example="mp", why=_DP),
    GuideFlag(("--data-parallel-hybrid-lb",), "warn", "vLLM", switch=True, why=_DP),
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
    GuideFlag(
        ("--cpu-offload-gb",),
        "refuse",
        "vLLM",
        example="100",
        why="k2serve offloads whole experts, not bytes: " + _GPU_EXPERTS,
    ),
    # ---- SGLang spellings -------------------------------------------------------------------
    GuideFlag(("--model-path",), "alias", "SGLang", target="--model", example="/m"),
    GuideFlag(("--tp", "--tp-size"), "alias", "SGLang", target="--tensor-parallel-size"),
    GuideFlag(("--dp-size", "--dp"), "one", "SGLang", why=_DP + _DP_EQ),
    GuideFlag(
        ("--ep-size", "--ep"),
        "alias",
        "SGLang",
        target="--enable-expert-parallel",
        convert="ep_size",
    ),
    GuideFlag(("--context-length",), "alias", "SGLang", target="--max-model-len", example="8192"),
    GuideFlag(
        ("--mem-fraction-static",),
        "alias",
        "SGLang",
        target="--gpu-memory-utilization",
        example="0.85",
    ),
    GuideFlag(
        ("--chunked-prefill-size",),
        "alias",
        "SGLang",
        target="--max-num-batched-tokens",
        convert="chunked_prefill",
        example="8192",
    ),
    GuideFlag(
        ("--max-running-requests",), "alias", "SGLang", target="--max-num-seqs", example="32"
    ),
    GuideFlag(
        ("--max-total-tokens",),
        "alias",
        "SGLang",
        target="--num-kv-pages",
        convert="tokens_to_pages",
        example="65536",
    ),
    GuideFlag(("--disable-cuda-graph",), "alias", "SGLang", target="--enforce-eager", switch=True),
    GuideFlag(
        ("--dist-init-addr",),
        "implemented",
        "SGLang",
        target="--dist-init-addr",
        example="10.0.0.1:5000",
    ),
    GuideFlag(
        ("--enable-dp-attention",),
        "refuse",
        "SGLang",
        switch=True,
        why="DP attention is not built; attention is tensor-parallel (--tensor-parallel-size)",
    ),
    GuideFlag(
        ("--cuda-graph-max-bs",),
        "warn",
        "SGLang",
        example="64",
        why="decode graphs are captured up to --max-num-seqs",
    ),
    GuideFlag(
        ("--moe-a2a-backend",),
        "warn",
        "SGLang",
        example="deepep",
        why="expert parallelism here combines experts with one all-reduce",
    ),
    GuideFlag(
        ("--enable-mixed-chunk",),
        "warn",
        "SGLang",
        switch=True,
        why="always so: prefill chunks and decodes share each step",
    ),
    GuideFlag(
        ("--watchdog-timeout",),
        "warn",
        "SGLang",
        example="1000",
        why="collective timeouts come from K2SERVE_DIST_TIMEOUT_S",
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
    GuideFlag(
        ("--kt-num-gpu-experts",), "alias", "KT-Kernel", target="--num-gpu-experts", example="8"
    ),
    GuideFlag(
        ("--kt-cpuinfer",),
        "alias",
        "KT-Kernel",
        target="K2SERVE_CPU_THREADS",
        convert="cpu_threads",
    ),
    GuideFlag(
        ("--kt-threadpool-count",),
        "alias",
        "KT-Kernel",
        target="(NUMA nodes)",
        convert="numa_nodes",
    ),
    GuideFlag(
        ("--kt-gpu-prefill-token-threshold",),
        "alias",
        "KT-Kernel",
        target="--gpu-prefill-token-threshold",
        example="4096",
    ),
    GuideFlag(
        ("--kt-enable-dynamic-expert-update",),
        "alias",
        "KT-Kernel",
        switch=True,
        target="--dynamic-expert-placement",
    ),
    GuideFlag(
        ("--kt-method",),
        "warn",
        "KT-Kernel",
        example="RAWINT4",
        why=_INT4 + "; the CPU kernel follows it (K2SERVE_CPU_KERNEL picks native / torch)",
    ),
    GuideFlag(
        ("--kt-weight-path",),
        "warn",
        "KT-Kernel",
        example="/m",
        why="the CPU experts are read from the --model checkpoint itself",
    ),
    GuideFlag(
        ("--kt-amx-weight-path",),
        "warn",
        "KT-Kernel",
        example="/m",
        why="the CPU experts are read from the --model checkpoint itself",
    ),
    GuideFlag(
        ("--kt-max-deferred-experts-per-token",),
        "warn",
        "KT-Kernel",
        example="2",
        why="expert deferral is not built: every routed expert is computed in its "
        "layer (exact outputs)",
    ),
    GuideFlag(
        ("--kt-expert-placement-strategy",),
        "warn",
        "KT-Kernel",
        example="frequency",
        why="the GPU gets experts 0..N-1, or the most-routed ones with "
        "--expert-placement-file (written by --record-routing)",
    ),
    GuideFlag(
        ("--kt-gpu-experts-ratio",),
        "refuse",
        "KT-Kernel",
        example="0.1",
        why=_GPU_EXPERTS + ", e.g. ratio 0.1 of 384 = --num-gpu-experts 38",
    ),
    GuideFlag(
        ("--init-expert-location",),
        "refuse",
        "KT-Kernel",
        example="stats.pt",
        why="use --expert-placement-file COUNTS.json (the file --record-routing writes)",
    ),
    GuideFlag(("--n-cpu-moe", "--cpu-moe"), "refuse", "llama.cpp", example="30", why=_GPU_EXPERTS),
)

# Built on other branches (speculative decoding, host KV tier, vision): accepted, inactive here.
PENDING: tuple[GuideFlag, ...] = tuple(
    GuideFlag((f,), "pending", "vLLM", why=why, example=ex)
    for f, why, ex in (
        ("--speculative-config", "speculative decoding", '{"method": "eagle3"}'),
        ("--swap-space", "the host KV tier", "16"),
        ("--kv-offloading-size", "the host KV tier", "64"),
        ("--kv-offloading-backend", "the host KV tier", "native"),
        ("--mm-encoder-tp-mode", "the vision encoder", "data"),
        ("--limit-mm-per-prompt", "the vision encoder", '{"image": 2}'),
        ("--allowed-media-domains", "the vision encoder", "example.com"),
        ("--allowed-local-media-path", "the vision encoder", "/data"),
    )
)

ALL_FLAGS = FLAGS + PENDING

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
    (
        "USE_NUMA",
        "warn",
        "the CPU experts always group threads by NUMA node "
        "(K2SERVE_NUMA_TOPOLOGY overrides the topology)",
    ),
)
