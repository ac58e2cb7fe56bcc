"""A compact byte-level BPE trainer that produces tiktoken mergeable ranks.

Owns: `train_bpe(text, num_ranks, pat_str)`.

Invariants:
- Ranks 0..255 are the single bytes, in byte order (as tiktoken's own trainer does).
- Rank 256+k is the k-th merge; every merged token is the concatenation of two lower-ranked
  tokens, so tiktoken's "merge the lowest-ranked pair" encoding reproduces training.
- Words are the pre-tokenization pieces of `pat_str` (regex.V1, which understands `&&`), so no
  token crosses a piece boundary.
- Deterministic: ties between pairs of equal count go to the lexicographically smallest pair.
- If the text runs out of pairs occurring at least twice before `num_ranks`, the rest is filled
  deterministically with concatenations of existing tokens (reachable, never used by the text).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict

import regex


def _pretokenize(text: str, pat_str: str) -> Counter[bytes]:
    pat = regex.compile(pat_str, flags=regex.V1)
    return Counter(m.encode("utf-8") for m in pat.findall(text))


def train_bpe(text: str, num_ranks: int, pat_str: str) -> dict[bytes, int]:
    """Train byte-level BPE on `text`; return exactly `num_ranks` mergeable ranks."""
    if num_ranks < 256:
        raise ValueError(f"num_ranks must be >= 256 (the single bytes), got {num_ranks}")
    ranks: dict[bytes, int] = {bytes([i]): i for i in range(256)}
    word_counts = _pretokenize(text, pat_str)
    words: list[list[bytes]] = [[bytes([b]) for b in w] for w in word_counts]
    freqs: list[int] = list(word_counts.values())

    pair_counts: dict[tuple[bytes, bytes], int] = defaultdict(int)
    pair_words: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in itertools.pairwise(w):
            pair_counts[(a, b)] += freqs[wi]
            pair_words[(a, b)].add(wi)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < num_ranks and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:  # stale entry
            continue
        if -neg < 2:
            break
        merged = pair[0] + pair[1]
        if merged in ranks:  # same bytes reached by another split: merge without a new rank
            pass
        else:
            ranks[merged] = len(ranks)
        changed: set[tuple[bytes, bytes]] = set()
        for wi in list(pair_words[pair]):
            w, f = words[wi], freqs[wi]
            for a, b in itertools.pairwise(w):
                pair_counts[(a, b)] -= f
                changed.add((a, b))
            out: list[bytes] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == pair[0] and w[i + 1] == pair[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for a, b in itertools.pairwise(out):
                pair_counts[(a, b)] += f
                pair_words[(a, b)].add(wi)
                changed.add((a, b))
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
                pair_words.pop(p, None)

    _pad(ranks, num_ranks)
    return ranks


def _pad(ranks: dict[bytes, int], num_ranks: int) -> None:
    """Fill up to `num_ranks` with concatenations of existing tokens, in rank order."""
    if len(ranks) >= num_ranks:
        return
    by_rank = sorted(ranks, key=ranks.__getitem__)
    # Pair every token with the printable ASCII bytes first, then with everything.
    seconds = [bytes([c]) for c in range(32, 127)]
    n = 0
    while len(ranks) < num_ranks:
        first = by_rank[n % len(by_rank)]
        for s in seconds:
            cand = first + s
            if cand not in ranks:
                ranks[cand] = len(ranks)
                by_rank.append(cand)
                if len(ranks) >= num_ranks:
                    return
        n += 1
