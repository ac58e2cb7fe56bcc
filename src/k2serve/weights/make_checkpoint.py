"""`k2serve make-checkpoint`: write a random checkpoint in the exact real layout.

Writes config.json (real keys + quantization_config), generation_config.json (and for the
K2.5 presets preprocessor_config.json), sharded
safetensors with the real tensor names and model.safetensors.index.json, and the tokenizer
files (tiktoken.model, tokenizer_config.json, chat_template.jinja) when `k2serve.tokenizer` is
available.

Invariants: tensors are generated and written one at a time (peak memory ~ one shard); the
result loads with `load_model` and with transformers (after dequantization).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from k2serve.config import ModelConfig
from k2serve.weights.presets import FORMATS, PRESETS, preset_config, vision_preset

logger = logging.getLogger(__name__)

DRAFT_LAYOUTS = ("eagle3-llama", "eagle3-mla", "eagle3.1-llama", "eagle3.1-mla")


def make_checkpoint(
    out_dir: str | os.PathLike,
    config_dict: dict,
    *,
    seed: int = 0,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer: bool = True,
    progress: bool = True,
) -> ModelConfig:
    """Write a random checkpoint of `config_dict` (a config.json dict) into `out_dir`."""
    from k2serve.weights.loader import build_meta_model, checkpoint_name
    from k2serve.weights.random_init import random_tensors
    from k2serve.weights.writer import ShardedWriter

    config = ModelConfig.from_hf(config_dict)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model = build_meta_model(config, torch.bfloat16)  # checkpoint dtypes: bf16 + quantized
    writer = ShardedWriter(out_dir, max_shard_bytes)
    n = len(model.state_dict())
    for name, t in tqdm(
        random_tensors(model, seed), total=n, desc="Writing weights", disable=not progress
    ):
        writer.add(checkpoint_name(name, config), t)
    files = writer.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
        f.write("\n")
    gen = {
        "_from_model_config": True,
        "bos_token_id": config_dict.get("bos_token_id"),
        "eos_token_id": config_dict.get("eos_token_id"),
        "do_sample": True,
        "temperature": 0.6,
        "transformers_version": config_dict.get("transformers_version", "4.48.3"),
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    if config.vision is not None:  # K2.5: the image preprocessor's settings
        from k2serve.vision_config import ImageProcessorConfig

        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(ImageProcessorConfig().to_json(), f, indent=2)
            f.write("\n")
    if tokenizer:
        _write_tokenizer(out_dir, config.vocab_size)
    logger.info("wrote %d shards to %s", len(files), out_dir)
    return config


def _write_tokenizer(out_dir: str, vocab_size: int) -> None:
    try:
        from k2serve.tokenizer.files import write_tokenizer_files
    except ImportError:
        logger.info("k2serve.tokenizer.files is not available: no tokenizer files written")
        return
    write_tokenizer_files(out_dir, vocab_size)
    try:
        from k2serve.tokenizer.chat_template import builtin_chat_template
    except ImportError:
        return
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(builtin_chat_template())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--format", choices=FORMATS, default="bf16", dest="fmt")
    parser.add_argument("--layers", type=int, default=None, help="number of decoder layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-shard-size", type=float, default=2.0, help="shard size limit in GB (default 2)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    parser.add_argument(
        "--draft",
        choices=DRAFT_LAYOUTS,
        default=None,
        help="write a random EAGLE-3 draft head for the preset target instead (Llama-layer or "
        "MLA layout; eagle3.1 adds fc_norm / norm_output) for --speculative-config",
    )
    parser.add_argument(
        "--draft-vocab-size", type=int, default=None, help="reduced draft vocabulary (d2t/t2d)"
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="the K2.5 format (KimiK25ForConditionalGeneration: vision tower + projector beside "
        "the text model; tiny/small get a 2-block tower, k2-slice the full-size one)",
    )


def run(args: argparse.Namespace) -> int:
    if args.max_shard_size <= 0:
        raise SystemExit(f"--max-shard-size must be positive, got {args.max_shard_size}")
    try:
        preset = vision_preset(args.preset) if args.vision else args.preset
        cfg = preset_config(preset, args.fmt, args.layers)
    except ValueError as e:
        raise SystemExit(f"make-checkpoint: {e}") from None
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"make-checkpoint: {args.out!r} exists and is not a directory")
    t0 = time.perf_counter()
    if args.draft is not None:
        from k2serve.weights.eagle3 import write_eagle3_checkpoint

        layout = args.draft.rsplit("-", 1)[1]
        write_eagle3_checkpoint(
            args.out, ModelConfig.from_hf(cfg), layout, eagle31=args.draft.startswith("eagle3.1"),
            draft_vocab_size=args.draft_vocab_size, seed=args.seed,
        )  # fmt: skip
        print(f"wrote a random {args.draft} draft head for {args.preset} to {args.out}")
        return 0
    try:
        make_checkpoint(
            args.out,
            cfg,
            seed=args.seed,
            max_shard_bytes=int(args.max_shard_size * 1024**3),
            tokenizer=not args.no_tokenizer,
        )
    except OSError as e:
        raise SystemExit(f"make-checkpoint: cannot write {args.out!r}: {e}") from None
    dt = time.perf_counter() - t0
    print(f"wrote {args.preset} ({args.fmt}) checkpoint to {args.out} in {dt:.1f}s")
    return 0
