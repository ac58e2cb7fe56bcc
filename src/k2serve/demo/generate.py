"""Greedy generation over the model's plain forward (no KV cache): the demo's own checker.

Owns: `greedy_generate` and `chat_greedy`, used by scripts/train_demo.py and tests/demo to check
the demo contract without the engine. Each step recomputes the whole sequence (naive MLA with
`attn_metadata=None`), which is fine for a few-MB model and short prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from k2serve.tokenizer import KimiTokenizer


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], str]:
    """-> (new token ids without the stop token, finish_reason "stop" | "length")."""
    ids = list(prompt_ids)
    out: list[int] = []
    device = model.device
    for _ in range(max_new_tokens):
        t = torch.tensor(ids, dtype=torch.long, device=device)  # [T]
        hidden = model(t, torch.arange(len(ids), device=device))  # [T, hidden]
        nxt = int(model.compute_logits(hidden[-1:])[0].argmax())
        if nxt in stop_ids:
            return out, "stop"
        out.append(nxt)
        ids.append(nxt)
    return out, "length"


def chat_greedy(
    model,
    tokenizer: KimiTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = True,
    max_new_tokens: int = 64,
) -> tuple[str, str]:
    """Render, generate greedily, decode (special tokens skipped) -> (text, finish_reason)."""
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template_kwargs={"thinking": thinking}
    )
    ends = (tokenizer.token_to_id("<|im_end|>"), tokenizer.eos_token_id)
    stop = {t for t in ends if t is not None}
    new, reason = greedy_generate(model, tokenizer.encode(prompt), max_new_tokens, stop)
    return tokenizer.decode(new, skip_special_tokens=True), reason
