"""N-gram (prompt lookup) drafting, as vLLM's `method: "ngram"`.

For a request with tokens t[0..N): for n from `prompt_lookup_max` down to `prompt_lookup_min`,
look for an earlier occurrence of the last n tokens t[N-n..N); at the first (earliest) match of
the longest such n, propose the k tokens that followed it (fewer when the match is near the end).
No match: no draft. Pure host work on token ids; no model, no state between steps.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (the prompt and the output so far)."""
    num = len(tokens)
    if k <= 0 or num < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = arr[num - n :]
        # windows[i] = arr[i : i + n] for every i with i + n < num (a match must have a successor)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: num - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : min(start + k, num)].tolist()
    return []
