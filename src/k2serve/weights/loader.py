"""Streaming loader: checkpoint directory -> DeepseekV3ForCausalLM on a device.

Invariants:
- The model is built on the meta device (no allocation), then each parameter is filled from
  its safetensors tensor, read through safe_open (mmap) one tensor at a time and copied to the
  device at once, so host memory peaks near the model's own size on CPU plus one shard (the
  mapped pages of the open shard), and near one shard when the device is a GPU.
- Each tensor is cast to the dtype of the parameter it fills (quantized tensors keep their
  stored dtype, `e_score_correction_bias` stays float32, the rest becomes `dtype`).
- Skipped: `*.rotary_emb.inv_freq`, MTP layers (index >= num_hidden_layers), and, for a K2.5
  config without `vision_config`, the vision tower and projector.
- K2.5 names are the original checkpoint's; the few that transformers' `save_pretrained`
  writes differently (`language_model.model.blocks.N`, `model.mm_projector.`,
  `vision_tower.encoder.patch_embed.`) are read as the originals (`_TRANSFORMERS_NAMES`).
- A missing, unexpected or misshapen tensor, one holding NaN / inf, or a shard that cannot be
  read (truncated, corrupt) raises `CheckpointError` naming it.
- `expert_placement` (k2serve.moe.placement) puts the CPU-placed experts' tensors in host
  memory as they are read (never on the GPU); `tensor_device(name)` is the general per-tensor
  device map (None = `device`). Dummy weights are generated on `device` one tensor at a time and
  then moved (at most one tensor transiently). A standalone `load_model` call gets default
  backends (`k2serve.model.backends.setup_backends(model, placement=expert_placement)`:
  Triton on CUDA, torch elsewhere); the engine passes `setup_backends=False` and chooses them
  once, for its config and KV cache, in its setup pipeline (k2serve.engine.setup.setup_rank).
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from k2serve.config import ModelConfig
from k2serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from k2serve.quant import linear_scheme
from k2serve.weights.writer import INDEX_NAME

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model; the message names the tensor."""


def _weight_map(model_dir: str) -> dict[str, str]:
    """tensor name -> shard file name (from the index, or the single model.safetensors)."""
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid index (truncated?): {e}") from None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index} has no weight_map")
        return wm
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        with _open_shard(single) as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise CheckpointError(f"no {INDEX_NAME} or model.safetensors in {model_dir}")


def _open_shard(path: str):
    """safe_open, with a truncated or corrupt file reported as a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise CheckpointError(
            f"cannot read {path} ({size} bytes): {e}; the file is truncated or corrupt "
            "(an interrupted download?): fetch it again"
        ) from None


# fp8 NaN bit patterns (e4m3fn has no inf: S.1111.111 is NaN; e5m2: exponent 11111 is inf/NaN)
_FP8_BAD = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


def _check_finite(t: torch.Tensor, ckpt_name: str, shard: str) -> None:
    """Refuse a tensor with NaN or inf in it: it would make every logit NaN, silently.

    One elementwise pass over each floating tensor, on the device it was just copied to
    (integer / packed INT4 tensors have no NaN and are skipped; so are tensors on the meta
    device, which hold no values: a placement dry run loads onto it)."""
    if t.is_meta:
        return
    if t.dtype in _FP8_BAD:
        mask, bad = _FP8_BAD[t.dtype]
        ok = not bool(((t.view(torch.uint8) & mask) == bad).any())
    elif t.is_floating_point():
        ok = bool(torch.isfinite(t).all())
    else:
        return
    if not ok:
        what = "NaN" if t.dtype in _FP8_BAD or bool(torch.isnan(t).any()) else "inf"
        raise CheckpointError(
            f"tensor {ckpt_name!r} in {shard} holds {what} values; the checkpoint is broken "
            "(or was converted badly)"
        )


# transformers 5.x save_pretrained of Kimi_K25ForConditionalGeneration -> original names
_TRANSFORMERS_NAMES = (
    (re.compile(r"^language_model\.model\.blocks\."), "language_model.model.layers."),
    (re.compile(r"^model\.mm_projector\."), "mm_projector."),
    (re.compile(r"^vision_tower\.encoder\.patch_embed\."), "vision_tower.patch_embed."),
)
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _model_name(ckpt_name: str, config: ModelConfig) -> str | None:
    """The state_dict name for a checkpoint tensor, or None when it is skipped."""
    prefix = config.weight_prefix
    if prefix:
        for pattern, repl in _TRANSFORMERS_NAMES:
            ckpt_name = pattern.sub(repl, ckpt_name)
        if ckpt_name.startswith(_VISION_PREFIXES):
            return ckpt_name if config.vision is not None else None
        if not ckpt_name.startswith(prefix):
            return None
        ckpt_name = ckpt_name[len(prefix) :]
    if ckpt_name.endswith("rotary_emb.inv_freq"):
        return None
    m = _LAYER_RE.match(ckpt_name)
    if m and int(m.group(1)) >= config.num_hidden_layers:
        return None  # MTP / next-n layers
    return ckpt_name


def checkpoint_name(name: str, config: ModelConfig) -> str:
    """The original checkpoint name of state_dict tensor `name` (inverse of `_model_name`)."""
    return name if name.startswith(_VISION_PREFIXES) else config.weight_prefix + name


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter/buffer `name` of `model` (e.g. a meta one) with `tensor`."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = tensor
    else:
        raise CheckpointError(f"model has no tensor {name!r}")


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cast(t: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype == like.dtype:
        return t
    if t.dtype in _FP8:
        raise CheckpointError(
            f"tensor {name!r} is {t.dtype} but has no weight_scale_inv next to it (or "
            "quantization_config is not fp8)"
        )
    if not (like.dtype.is_floating_point and t.dtype.is_floating_point):
        raise CheckpointError(f"tensor {name!r} is {t.dtype}; the model needs {like.dtype}")
    return t.to(like.dtype)


def build_meta_model(
    config: ModelConfig, dtype: torch.dtype, tensor_names: frozenset[str] | None = None
) -> DeepseekV3ForCausalLM:
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(
            config, dtype, lambda n: linear_scheme(n, config.quant, tensor_names)
        )


def load_model(
    model_dir: str | os.PathLike | None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    config: ModelConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    expert_placement=None,
    tensor_device=None,
    setup_backends: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
    shard=None,
) -> DeepseekV3ForCausalLM:
    """Load (or, with load_format="dummy", randomly initialise) the model on `device`.

    With `tp_size > 1`: only tensor-parallel rank `tp_rank`'s shard (k2serve.distributed), each
    tensor's slice read on its own so the full model is never in memory; the model gets
    `.tp_plan` and runs only together with the other ranks in a torch.distributed group.
    `shard(meta_model) -> ShardPlan`: another sharding of the meta model instead (data-parallel
    ranks: k2serve.distributed.expert_parallel.shard_model_ep)."""
    tp = shard if shard is not None else (tp_rank, tp_size, expert_parallel)
    model = _load(model_dir, dtype, device, load_format, config, seed, progress,
                  _device_map(device, expert_placement, tensor_device), tp)  # fmt: skip
    if setup_backends:
        from k2serve.model.backends import setup_backends as choose_and_install

        choose_and_install(model, placement=expert_placement)
    return model


def _device_map(device, placement, tensor_device):
    """name -> device of that tensor."""
    device = torch.device(device)

    def dev(name: str) -> torch.device:
        if placement is not None and placement.tensor_on_cpu(name):
            return torch.device("cpu")
        d = tensor_device(name) if tensor_device is not None else None
        return torch.device(d) if d is not None else device

    return dev


def _load(model_dir, dtype, device, load_format, config, seed, progress, device_of, tp):
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    device = torch.device(device)
    if config is None:
        if model_dir is None:
            raise ValueError("load_model needs model_dir or config")
        config = ModelConfig.from_hf(model_dir)
    if load_format == "dummy":
        return _load_dummy(config, dtype, device, seed, progress, device_of, tp)
    if model_dir is None:
        raise ValueError(f"load_format={load_format!r} needs a model_dir")
    model_dir = os.fspath(model_dir)
    weight_map = _weight_map(model_dir)
    model = build_meta_model(config, dtype, frozenset(weight_map))
    plan = tp(model) if callable(tp) else _shard(model, *tp)  # None without tensor parallel
    expected = dict(model.state_dict(keep_vars=True))  # name -> meta tensor (this rank's shape)

    by_shard: dict[str, list[tuple[str, str]]] = {}
    for ckpt_name, shard in weight_map.items():
        name = _model_name(ckpt_name, config)
        if name is None or (plan is not None and plan.skips(name)):
            continue
        if name not in expected:
            raise CheckpointError(
                f"unexpected tensor {ckpt_name!r} in {shard}: the model (config.json) has no such "
                "parameter"
            )
        by_shard.setdefault(shard, []).append((ckpt_name, name))
    wanted = {n for items in by_shard.values() for _, n in items}
    missing = [checkpoint_name(n, config) for n in expected if n not in wanted]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {model_dir}")

    total = sum(len(v) for v in by_shard.values())
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for shard in sorted(by_shard):
        path = os.path.join(model_dir, shard)
        if not os.path.exists(path):
            raise CheckpointError(f"shard {shard} named in {INDEX_NAME} does not exist")
        with _open_shard(path) as f:
            present = set(f.keys())
            for ckpt_name, name in by_shard[shard]:
                if ckpt_name not in present:
                    raise CheckpointError(
                        f"tensor {ckpt_name!r} is not in {shard} as the index says"
                    )
                meta = expected[name]
                t = f.get_slice(ckpt_name)
                shape = tuple(t.get_shape())
                want = plan.full_shape(name, meta.shape) if plan else tuple(meta.shape)
                if shape != want:
                    raise CheckpointError(
                        f"tensor {ckpt_name!r} has shape {list(shape)}, the model expects "
                        f"{list(want)}"
                    )
                t = plan.read(name, t) if plan else f.get_tensor(ckpt_name)  # this rank's part
                t = _cast(t, meta, ckpt_name)
                device = device_of(name)
                # NOTE: get_tensor returns a view of the mmap; copy it into memory the model
                # owns, so the shard's pages are released when the shard is closed (peak host
                # memory = model + one shard, and the files may change after loading).
                t = t.to(device, copy=True) if t.device == device else t.to(device)
                _check_finite(t, ckpt_name, shard)
                set_tensor(model, name, t)
                bar.update(1)
    bar.close()
    model.eval()
    return model


def _shard(model, tp_rank: int, tp_size: int, expert_parallel: bool):
    """Make the meta `model` tensor-parallel rank tp_rank's shard; its ShardPlan (None when
    tp_size == 1)."""
    if tp_size == 1:
        return None
    from k2serve.distributed.parallel import shard_model

    return shard_model(model, tp_rank, tp_size, expert_parallel)


def _load_dummy(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    progress: bool,
    device_of=None,
    tp=(0, 1, False),  # (tp_rank, tp_size, expert_parallel) or a shard(model) callable
) -> DeepseekV3ForCausalLM:
    from k2serve.weights.random_init import random_tensors

    model = build_meta_model(config, dtype)
    n = len(model.state_dict())
    plan = tp(model) if callable(tp) else _shard(model, *tp)
    # NOTE: with tensor parallel each tensor is generated whole from the unsharded meta model
    # (so every rank sees a single-process load's values), then sliced.
    it = random_tensors(build_meta_model(config, dtype) if plan else model, seed, device)
    for name, t in tqdm(it, total=n, desc="Random weights", disable=not progress):
        if plan is not None:
            if plan.skips(name):
                continue
            t = plan.shard(name, t)
        set_tensor(model, name, t.to(device_of(name)) if device_of is not None else t)
    model.eval()
    return model
