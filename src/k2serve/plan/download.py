"""`k2serve download MODEL --dir DIR`: fetch a checkpoint from the Hugging Face hub.

Owns: the name -> repo id mapping (through `KNOWN_MODELS`), the list of files a k2serve
checkpoint needs (`ALLOW_PATTERNS`), the reachability check that makes an offline machine fail
fast with a clear message, and the post-download check that every shard of the index is there.

Invariants:
- Resumable: `snapshot_download` into `--dir` skips complete files and resumes partial ones.
- Token from `--token` or the `HF_TOKEN` environment variable, never printed.
- Exit codes: 0 done, 1 download failed (message on stderr), 2 bad arguments.
- No torch import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys

from k2serve.config import KNOWN_MODELS, ModelConfig

logger = logging.getLogger(__name__)

# Everything the loader, tokenizer and chat template need, and nothing else (no .bin, .pt, .gguf).
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "tiktoken.model",
    "*.tiktoken",
    "chat_template.jinja",
    "*.jinja",
    "*.py",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"{', '.join(KNOWN_MODELS)}, or a hub repo id (owner/name)")
    p.add_argument("--dir", required=True, help="target directory (created; resumable)")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument("--token", default=None, help="hub token (default: $HF_TOKEN)")
    p.add_argument("--endpoint", default=None, help="hub endpoint (default: $HF_ENDPOINT)")
    p.add_argument("--max-workers", type=int, default=8, help="parallel file downloads")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the hub to answer"
    )


def resolve_repo(model: str) -> tuple[str, int | None]:
    """(repo id, expected weight bytes or None) for a known name or an owner/name repo id."""
    key = model.lower()
    if key in KNOWN_MODELS:
        from k2serve.plan.weights import weight_bytes

        cfg, repo = KNOWN_MODELS[key]
        return repo, weight_bytes(ModelConfig.from_hf(cfg))
    if model.count("/") == 1 and all(model.split("/")):
        return model, None
    raise ValueError(
        f"unknown model {model!r}: give one of {', '.join(KNOWN_MODELS)} or a repo id owner/name"
    )


def missing_shards(model_dir: str) -> list[str]:
    """Shards named in model.safetensors.index.json that are absent from `model_dir`."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return []
    with open(index) as f:
        files = sorted(set(json.load(f).get("weight_map", {}).values()))
    return [s for s in files if not os.path.exists(os.path.join(model_dir, s))]


def _check_reachable(api, repo: str, revision: str | None, timeout: float) -> None:
    """Raise RuntimeError with a clear message unless the hub answers for `repo` in time."""
    from huggingface_hub import errors

    try:
        api.model_info(repo, revision=revision, timeout=timeout)
    except errors.GatedRepoError as e:
        raise RuntimeError(f"{repo} is gated: accept its license and set HF_TOKEN ({e})") from e
    except errors.RepositoryNotFoundError as e:
        raise RuntimeError(f"{repo} not found on the hub (or private: set HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise RuntimeError(f"revision {revision!r} of {repo} not found") from e
    except errors.HfHubHTTPError as e:
        raise RuntimeError(f"the hub refused {repo}: {e}") from e
    except Exception as e:  # connection refused, DNS, timeout, proxy: all mean unreachable
        raise RuntimeError(
            f"cannot reach the Hugging Face hub at {api.endpoint} within {timeout:g}s "
            f"({type(e).__name__}: {e}). This machine looks offline: download on a machine with "
            "network access and copy the directory, or set HF_ENDPOINT to a reachable mirror"
        ) from e


def download(
    model: str,
    model_dir: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    max_workers: int = 8,
    timeout: float = 10.0,
) -> str:
    """Download `model` into `model_dir`; return the directory. RuntimeError on failure."""
    from huggingface_hub import HfApi, constants, snapshot_download

    repo, expected = resolve_repo(model)
    token = token or os.environ.get("HF_TOKEN") or None
    if constants.HF_HUB_OFFLINE:
        raise RuntimeError(
            "HF_HUB_OFFLINE is set: k2serve download needs the network. Unset it, or copy a "
            "downloaded checkpoint directory here"
        )
    os.makedirs(model_dir, exist_ok=True)
    if expected:
        free = shutil.disk_usage(model_dir).free
        if free < expected * 0.99:
            logger.warning(
                "%s needs about %.0f GiB; %s has %.0f GiB free (already downloaded files count)",
                repo, expected / 2**30, model_dir, free / 2**30,
            )  # fmt: skip
    api = HfApi(endpoint=endpoint, token=token)
    _check_reachable(api, repo, revision, timeout)
    logger.info("downloading %s into %s", repo, model_dir)
    try:
        snapshot_download(
            repo,
            revision=revision,
            local_dir=model_dir,
            allow_patterns=ALLOW_PATTERNS,
            token=token,
            endpoint=endpoint,
            max_workers=max_workers,
            etag_timeout=timeout,
        )
    except Exception as e:
        raise RuntimeError(
            f"download of {repo} stopped: {type(e).__name__}: {e}. Run the same command again "
            "to resume"
        ) from e
    missing = missing_shards(model_dir)
    if missing:
        raise RuntimeError(f"{len(missing)} shards are missing after download: {missing[:3]}...")
    return model_dir


def run(args: argparse.Namespace) -> int:
    try:
        resolve_repo(args.model)
    except ValueError as e:
        print(f"k2serve download: {e}", file=sys.stderr)
        return 2
    try:
        out = download(
            args.model,
            args.dir,
            revision=args.revision,
            token=args.token,
            endpoint=args.endpoint,
            max_workers=args.max_workers,
            timeout=args.timeout,
        )
    except RuntimeError as e:
        print(f"k2serve download: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
