"""The bundled demo checkpoint: a tiny Kimi-shaped model (INT4 routed experts) that speaks the
Kimi dialect (thinking, tool calls). Trained by `scripts/train_demo.py`; the default model of
`k2serve serve`.

Invariant: `demo_path()` is a directory in the real checkpoint layout (config.json,
safetensors + index, tiktoken.model, tokenizer_config.json, chat_template.jinja,
generation_config.json).
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIRNAME = "kimi-k2-demo"
VISION_DEMO_DIRNAME = "kimi-k2.5-demo"  # the same text model + a tiny trained vision tower


def demo_path() -> Path:
    """Directory of the bundled demo checkpoint."""
    path = Path(__file__).resolve().parent / DEMO_DIRNAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo checkpoint is missing from {path}; run `python scripts/train_demo.py`"
        )
    return path


def demo_eagle3_path() -> Path:
    """Directory of the demo's EAGLE-3 draft head (Llama-layer layout), trained by
    `scripts/train_demo_eagle3.py`: `--speculative-config '{"method": "eagle3", "model": DIR,
    "num_speculative_tokens": 3}'`."""
    path = Path(__file__).resolve().parent / (DEMO_DIRNAME + "-eagle3")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo draft is missing from {path}; run `python scripts/train_demo_eagle3.py`"
        )
    return path


def vision_demo_path() -> Path:
    """Directory of the bundled K2.5-format demo (images: names a picture's colour and shape;
    trained by `scripts/train_vision_demo.py`). `k2serve serve kimi-k2.5-demo` serves it."""
    path = Path(__file__).resolve().parent / VISION_DEMO_DIRNAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the K2.5 demo checkpoint is missing from {path}; run "
            "`python scripts/train_vision_demo.py`"
        )
    return path
