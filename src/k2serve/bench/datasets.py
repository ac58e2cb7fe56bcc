"""Benchmark workloads: each turns flags into a list of `SampleRequest`s, deterministically by seed.

- `random`:  prompts of N words drawn from a list of common English words. Each word (with its
             leading space) is one token in the usual BPE vocabularies, so N words ~ N tokens; no
             tokenizer is needed. The server's `usage.prompt_tokens` is reported as the truth.
             Lengths are fixed, or uniform in [L*(1-r), L*(1+r)] with `--random-range-ratio r`
             (as vLLM).
- `sharegpt`: a ShareGPT JSON (list) or JSONL file; the first human turn is the prompt.
- `jsonl`:   one JSON object per line with `prompt` (text), `messages` (chat) or `conversations`
             (ShareGPT); optional `max_tokens` / `output_len`.
- `prefix`:  shared-prefix workload: a `prefix_len`-word prefix shared by a `share_ratio`
             fraction of the requests (spread over `num_prefixes` distinct prefixes), the rest
             get a unique prefix of the same length; then a random suffix.

Invariant: `SampleRequest.output_len` is what is asked for (`max_tokens`), never a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Common English words; with a leading space each is a single token in cl100k/o200k/Kimi-style
# BPE vocabularies, so a prompt of N of them is close to N tokens.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """the of and to in is was for on that with as it by at from his be an are this which or
    had not but were have one all their they has been its new more first when who can time
    would there also two after other into only may over some these most many any year people
    such used then world state school three city part work where between made under well
    each long high both while life through found day water group number house during home
    family small left name great last four side line free game show power case land music
    water before back about just like great every right place second sound point still help
    ten word north south east west open hand light early never table river black white green
    red blue""".split()
    )
)


class DatasetError(ValueError):
    """A workload cannot be built; the message names the flag, file or line at fault."""


@dataclass(frozen=True)
class SampleRequest:
    """One request to send. `prompt` is text, or a list of chat messages (chat API only)."""

    prompt: str | list[dict]
    prompt_len: int | None  # intended input length in words/tokens; None when unknown
    output_len: int | None  # max_tokens to request; None = leave it to the server


def random_words(rng: np.random.Generator, n: int) -> str:
    idx = rng.integers(0, len(WORDS), size=n)
    return " ".join(WORDS[i] for i in idx)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, name: str) -> np.ndarray:
    if mean < 0:
        raise DatasetError(f"--{name} must be >= 0, got {mean}")
    if not 0.0 <= ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return rng.integers(lo, hi + 1, size=n)


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` prompts of `prefix_len` + ~`input_len` words; the prefix is shared."""
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts, "random-input-len")
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts, "random-output-len")
    prefix = random_words(rng, prefix_len) + " " if prefix_len > 0 else ""
    out = []
    for i in range(num_prompts):
        n_in = max(1, int(in_lens[i]))
        out.append(
            SampleRequest(
                prefix + random_words(rng, n_in), prefix_len + n_in, max(1, int(out_lens[i]))
            )
        )
    return out


def prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    share_ratio: float = 1.0,
    num_prefixes: int = 1,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Shared-prefix workload; round(share_ratio * num_prompts) requests use a shared prefix."""
    if prefix_len < 1:
        raise DatasetError(f"--prefix-len must be >= 1, got {prefix_len}")
    if not 0.0 <= share_ratio <= 1.0:
        raise DatasetError(f"--prefix-share-ratio must be in [0, 1], got {share_ratio}")
    if num_prefixes < 1:
        raise DatasetError(f"--prefix-num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [random_words(rng, prefix_len) for _ in range(num_prefixes)]
    n_shared = round(share_ratio * num_prompts)
    shared = np.zeros(num_prompts, dtype=bool)
    shared[:n_shared] = True
    rng.shuffle(shared)
    in_lens = _lengths(rng, suffix_len, range_ratio, num_prompts, "random-input-len")
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts, "random-output-len")
    out = []
    j = 0  # shared requests take the prefixes round robin
    for i in range(num_prompts):
        if shared[i]:
            prefix = prefixes[j % num_prefixes]
            j += 1
        else:
            prefix = random_words(rng, prefix_len)
        n_in = max(1, int(in_lens[i]))
        text = prefix + " " + random_words(rng, n_in)
        out.append(SampleRequest(text, prefix_len + n_in, max(1, int(out_lens[i]))))
    return out


def _estimate_output_len(reply: str) -> int:
    # NOTE: no tokenizer on the client: ~4 characters per token for English. This only sets
    # max_tokens (what is asked for); measured counts always come from the server's usage.
    return max(1, math.ceil(len(reply) / 4))


def _from_conversation(conv: object, where: str, output_len: int | None) -> SampleRequest | None:
    if not isinstance(conv, list) or not conv:
        raise DatasetError(f"{where}: 'conversations' must be a non-empty list")
    turns = [t for t in conv if isinstance(t, dict)]
    human = next((t for t in turns if t.get("from") in ("human", "user")), None)
    if human is None or not str(human.get("value", "")).strip():
        return None  # no usable prompt (vLLM skips these too)
    idx = turns.index(human)
    reply = next(
        (t for t in turns[idx + 1 :] if t.get("from") in ("gpt", "assistant", "chatgpt")), None
    )
    if output_len is None:
        output_len = _estimate_output_len(str(reply.get("value", ""))) if reply else None
    return SampleRequest(str(human["value"]), None, output_len)


def _read_records(path: Path) -> list[tuple[str, object]]:
    """(location, record) pairs from a JSON list or a JSONL file."""
    if not path.is_file():
        raise DatasetError(f"--dataset-path {str(path)!r} is not a file")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from None
        return [(f"{path} item {i}", r) for i, r in enumerate(data)]
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not valid JSON: {e}") from None
    return records


def _cycle(samples: list[SampleRequest], num_prompts: int, path: Path) -> list[SampleRequest]:
    if not samples:
        raise DatasetError(f"{path}: no usable prompts")
    return [samples[i % len(samples)] for i in range(num_prompts)]


def sharegpt_dataset(
    path: str | Path, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """First human turn of each conversation; shuffled by seed (as vLLM); cycled if short."""
    path = Path(path)
    samples = []
    for where, rec in _read_records(path):
        if not isinstance(rec, dict) or "conversations" not in rec:
            raise DatasetError(f"{where}: a ShareGPT record needs a 'conversations' list")
        s = _from_conversation(rec["conversations"], where, output_len)
        if s is not None:
            samples.append(s)
    order = np.random.default_rng(seed).permutation(len(samples))
    return _cycle([samples[i] for i in order], num_prompts, path)


def jsonl_dataset(
    path: str | Path, num_prompts: int, output_len: int | None = None
) -> list[SampleRequest]:
    """Prompts in file order, cycled if the file is shorter than `num_prompts`."""
    path = Path(path)
    samples = []
    for where, rec in _read_records(path):
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: each line must be a JSON object")
        n = rec.get("max_tokens", rec.get("output_len"))
        if n is not None and (not isinstance(n, int) or n < 1):
            raise DatasetError(f"{where}: 'max_tokens'/'output_len' must be a positive int")
        n = output_len if output_len is not None else n
        if "prompt" in rec:
            if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
            samples.append(SampleRequest(rec["prompt"], None, n))
        elif "messages" in rec:
            msgs = rec["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise DatasetError(f"{where}: 'messages' must be a list of objects")
            samples.append(SampleRequest(msgs, None, n))
        elif "conversations" in rec:
            s = _from_conversation(rec["conversations"], where, n)
            if s is not None:
                samples.append(s)
        else:
            raise DatasetError(f"{where}: needs 'prompt', 'messages' or 'conversations'")
    return _cycle(samples, num_prompts, path)


def _text(content: object) -> str:
    """An OpenAI message's content: the string, or the text parts of a part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def hf_dataset(
    path: str | Path, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """`--dataset-name hf` from a local file: ShareGPT records (`conversations` of from/value)
    or VisionArena / OpenAI ones (`conversation` or `messages` of role/content; images are
    left out: the first user turn's text is the prompt). Shuffled by seed, cycled if short."""
    p = Path(path)
    if not p.exists() and "/" in str(path) and not str(path).startswith((".", "/")):
        raise DatasetError(
            f"--dataset-path {str(path)!r} looks like a hub dataset id: k2serve bench reads "
            "local files only; download it (huggingface-cli download --repo-type dataset "
            f"{path}) and pass the JSON / JSONL file"
        )
    samples = []
    for where, rec in _read_records(p):
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: a record must be a JSON object")
        if "conversations" in rec:
            s = _from_conversation(rec["conversations"], where, output_len)
        elif isinstance(msgs := rec.get("conversation", rec.get("messages")), list):
            turns = [t for t in msgs if isinstance(t, dict)]
            conv = [{"from": t.get("role"), "value": _text(t.get("content"))} for t in turns]
            s = _from_conversation(conv, where, output_len) if conv else None
        else:
            raise DatasetError(
                f"{where}: needs 'conversations' (ShareGPT) or 'conversation' / 'messages' "
                "(VisionArena, OpenAI)"
            )
        if s is not None:
            samples.append(s)
    order = np.random.default_rng(seed).permutation(len(samples))
    return _cycle([samples[i] for i in order], num_prompts, p)
