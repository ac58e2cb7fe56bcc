"""Image workloads for `k2serve bench` (K2.5 servers): synthetic images on random prompts, or a
local dataset file in the ShareGPT-4V / VisionArena shape. Images travel as data URLs in chat
`image_url` parts, so the measured TTFT includes the server's fetch, decode, preprocessing and
vision encoding.

- `with_synthetic_images(samples, sizes, per_prompt, seed)`: each text prompt becomes a user
  message with `per_prompt` random-noise PNGs (sizes cycled) before the text;
- `vision_dataset(path, n, output_len, seed)`: JSON / JSONL records holding a prompt
  (`conversations` ShareGPT-style with `<image>` markers, `conversation` VisionArena-style
  [[{role, content}]], or `prompt`) and images (`image`: a path relative to the file, a URL or
  a data URL; or `images`: a list of those or of {"bytes": base64} / {"path": ...} objects).
"""

from __future__ import annotations

import base64
import io
import mimetypes
from pathlib import Path

import numpy as np

from k2serve.bench.datasets import (
    DatasetError,
    SampleRequest,
    _cycle,
    _estimate_output_len,
    _read_records,
)


def parse_size(text: str) -> tuple[int, int]:
    """'1024x768' or '512' -> (width, height)."""
    w, _, h = text.lower().partition("x")
    try:
        size = (int(w), int(h or w))
    except ValueError:
        raise DatasetError(f"--random-image-size {text!r} is not WxH (e.g. 1024x1024)") from None
    if min(size) < 1 or max(size) > 16384:
        raise DatasetError(f"--random-image-size {text!r}: sides must be in 1..16384")
    return size


def synthetic_png(w: int, h: int, rng: np.random.Generator) -> str:
    from PIL import Image

    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _message(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def with_synthetic_images(
    samples: list[SampleRequest], sizes: list[tuple[int, int]], per_prompt: int, seed: int = 0
) -> list[SampleRequest]:
    if per_prompt < 1:
        return samples
    rng = np.random.default_rng(seed + 1)
    pool = [synthetic_png(w, h, rng) for w, h in sizes]  # one picture per size, reused
    out, k = [], 0
    for s in samples:
        urls = []
        for _ in range(per_prompt):
            urls.append(pool[k % len(pool)])
            k += 1
        text = s.prompt if isinstance(s.prompt, str) else str(s.prompt)
        out.append(SampleRequest(_message(text, urls), s.prompt_len, s.output_len))
    return out


def _url_of(ref: object, base: Path, where: str) -> str:
    if isinstance(ref, dict):
        if "bytes" in ref and ref["bytes"]:
            data = ref["bytes"]
            b = data if isinstance(data, str) else base64.b64encode(bytes(data)).decode()
            return "data:image/png;base64," + b
        ref = ref.get("path") or ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise DatasetError(f"{where}: an image must be a path, a URL or {{'bytes': ...}}")
    if ref.startswith(("http://", "https://", "data:")):
        return ref
    path = (base / ref) if not Path(ref).is_absolute() else Path(ref)
    if not path.is_file():
        raise DatasetError(f"{where}: image file {str(path)!r} does not exist")
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def _prompt_and_reply(rec: dict, where: str) -> tuple[str, str | None]:
    if "conversations" in rec:  # ShareGPT-4V
        turns = [t for t in rec["conversations"] if isinstance(t, dict)]
        human = next((t for t in turns if t.get("from") in ("human", "user")), None)
        if human is None:
            raise DatasetError(f"{where}: no human turn")
        i = turns.index(human)
        reply = next((t for t in turns[i + 1 :] if t.get("from") in ("gpt", "assistant")), None)
        return str(human.get("value", "")), (str(reply.get("value", "")) if reply else None)
    if "conversation" in rec:  # VisionArena-Chat: [[{"role", "content"}, ...]]
        conv = rec["conversation"]
        turns = conv[0] if conv and isinstance(conv[0], list) else conv
        user = next((t for t in turns if t.get("role") == "user"), None)
        if user is None:
            raise DatasetError(f"{where}: no user turn")
        reply = next((t for t in turns if t.get("role") == "assistant"), None)
        return str(user.get("content", "")), (str(reply.get("content", "")) if reply else None)
    if isinstance(rec.get("prompt"), str):
        return rec["prompt"], None
    raise DatasetError(f"{where}: needs 'conversations', 'conversation' or 'prompt'")


def vision_dataset(
    path: str | Path, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    path = Path(path)
    samples = []
    for where, rec in _read_records(path):
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: each record must be an object")
        refs = rec.get("images", rec.get("image"))
        refs = refs if isinstance(refs, list) else ([refs] if refs is not None else [])
        urls = [_url_of(r, path.parent, where) for r in refs]
        text, reply = _prompt_and_reply(rec, where)
        text = text.replace("<image>", "").strip() or "Describe the image."
        n = output_len if output_len is not None else rec.get("max_tokens")
        if n is None and reply:
            n = _estimate_output_len(reply)
        samples.append(SampleRequest(_message(text, urls), None, n))
    order = np.random.default_rng(seed).permutation(len(samples))
    return _cycle([samples[i] for i in order], num_prompts, path)
