"""Where the data-parallel ranks sit: flag checks and the node layout of `--data-parallel-*`.

vLLM's launch (Moonshot's K2 guide): node 0 `serve --data-parallel-size 16
--data-parallel-size-local 8 --data-parallel-address A --data-parallel-rpc-port P`; node 1 the
same plus `--headless --data-parallel-start-rank 8`. Here the data-parallel ranks are one
torch.distributed group driven from node 0 (k2serve.engine.dp), so the layout maps onto the
multi-node machinery of tensor parallelism (`NodeSpec`): nnodes = size / size_local,
node_rank = start_rank / size_local, node 0 at data_parallel_address:data_parallel_rpc_port
(it also listens on port + 1 for the headless nodes' control connections).
"""

from __future__ import annotations

import json

from k2serve.distributed.nodes import NodeSpec


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    return v


def check_data_parallel(cfg) -> None:
    """ValueError naming the flag for a data-parallel layout that cannot work. SGLang's
    `--tp N --dp-size N --enable-dp-attention` becomes `-dp N` (tp 1): in SGLang every GPU
    counts in --tp, here each data-parallel rank is one GPU."""
    dp, tp = cfg.data_parallel_size, cfg.tensor_parallel_size
    _int("data_parallel_size", dp, 1)
    if cfg.enable_dp_attention and tp > 1:
        if dp not in (1, tp):
            raise ValueError(
                f"--enable-dp-attention with --tp {tp} --dp-size {dp}: attention tensor "
                "parallelism inside a data-parallel rank is not supported; use --dp-size "
                f"{tp} (one GPU per data-parallel rank)"
            )
        object.__setattr__(cfg, "data_parallel_size", tp)
        object.__setattr__(cfg, "tensor_parallel_size", 1)
        dp, tp = tp, 1
    if dp > 1 and tp > 1:
        raise ValueError(
            f"data_parallel_size={dp} with tensor_parallel_size={tp}: each data-parallel rank "
            "is one GPU here (attention data parallel, experts expert-parallel); give "
            f"--data-parallel-size {dp * tp} instead"
        )
    if dp > 1 and cfg.nnodes > 1:
        _from_torchrun_flags(cfg)
    local = cfg.data_parallel_size_local if cfg.data_parallel_size_local is not None else dp
    _int("data_parallel_size_local", local, 1)
    if dp % local:
        raise ValueError(
            f"data_parallel_size={dp} is not a multiple of data_parallel_size_local={local}"
        )
    start = _int("data_parallel_start_rank", cfg.data_parallel_start_rank, 0)
    if start % local or start >= dp:
        raise ValueError(
            f"data_parallel_start_rank={start} must be a multiple of data_parallel_size_local="
            f"{local} below data_parallel_size={dp}"
        )
    port = cfg.data_parallel_rpc_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65534:
        raise ValueError(f"data_parallel_rpc_port={port!r} must be in 1..65534")
    if dp > 1:
        for name in ("num_gpu_experts", "expert_placement_file", "record_routing"):
            if getattr(cfg, name, None) is not None:
                raise ValueError(f"{name} (experts in host RAM) is not supported with "
                                 f"data_parallel_size={dp}: the experts are spread over the "
                                 "data-parallel ranks' GPUs")  # fmt: skip
        if getattr(cfg, "dynamic_expert_placement", False):
            raise ValueError("dynamic_expert_placement is for one GPU with host-RAM experts; with "
                             "--data-parallel-size use --enable-eplb")  # fmt: skip
    eplb = cfg.eplb_config
    if eplb is not None:
        eplb_config(cfg)  # raises EplbError (a ValueError) naming the key
    if (cfg.enable_eplb or eplb is not None) and dp == 1:
        raise ValueError("--enable-eplb / --eplb-config need --data-parallel-size > 1")


def _from_torchrun_flags(cfg) -> None:
    """`-dp N --nnodes K --node-rank R --master-addr A --master-port P` (what the deploy
    templates pass every node) -> N / K ranks per node, this node's first rank R * N / K, node 0
    at A:P; the data-parallel spellings, if given too, must agree."""
    dp, nnodes, node_rank = cfg.data_parallel_size, cfg.nnodes, cfg.node_rank
    if dp % nnodes:
        raise ValueError(f"data_parallel_size={dp} is not a multiple of nnodes={nnodes}")
    local = dp // nnodes
    if cfg.data_parallel_size_local not in (None, local):
        raise ValueError(
            f"data_parallel_size_local={cfg.data_parallel_size_local} disagrees with "
            f"data_parallel_size={dp} over nnodes={nnodes}"
        )
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank!r} must be in [0, nnodes={nnodes})")
    if cfg.data_parallel_start_rank not in (0, node_rank * local):
        raise ValueError(
            f"data_parallel_start_rank={cfg.data_parallel_start_rank} disagrees with "
            f"node_rank={node_rank} x {local} ranks per node"
        )
    for k, v in (("data_parallel_size_local", local),
                 ("data_parallel_start_rank", node_rank * local),
                 ("data_parallel_address", cfg.data_parallel_address or cfg.master_addr),
                 ("data_parallel_rpc_port", cfg.master_port),
                 ("nnodes", 1), ("node_rank", 0)):  # fmt: skip
        object.__setattr__(cfg, k, v)


def eplb_config(cfg):
    """The EplbConfig of `--eplb-config` (JSON text or a dict); defaults without it."""
    from k2serve.moe.eplb import EplbConfig, EplbError

    raw = cfg.eplb_config
    if raw is None:
        return EplbConfig()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise EplbError(f"--eplb-config is not JSON: {e}") from None
    return EplbConfig.from_dict(raw)


def dp_node_spec(cfg) -> NodeSpec | None:
    """The node layout of the data-parallel group (None on one node)."""
    dp = cfg.data_parallel_size
    local = cfg.data_parallel_size_local or dp
    if local == dp:
        return None
    return NodeSpec(
        nnodes=dp // local,
        node_rank=cfg.data_parallel_start_rank // local,
        master_addr=cfg.data_parallel_address or cfg.master_addr,
        master_port=cfg.data_parallel_rpc_port,
        world_size=dp,
        join_timeout_s=float(cfg.dist_join_timeout),
    )
