"""Suffix decoding (Arctic Inference's SuffixDecoding, `method: "suffix"`), model-free drafting.

Two suffix tries of bounded depth D (`suffix_decoding_max_tree_depth`):
- a global one over the outputs of the last `suffix_decoding_max_cached_requests` finished
  requests (`SuffixTrie`; the oldest is removed when a new one comes in: its counts are
  subtracted);
- one per request over its own prompt and output. It is kept implicit: the trie's node for the
  request's context is the set of positions where that context occurs, found with numpy over
  the token array each step (`match_in_sequence`), which gives the same counts as building the
  trie (D nodes per prompt token: too slow in Python for long agent prompts) and holds no state
  between steps.

A trie holds every substring of length <= D of its sequences as a path from the root, each node
counting how often its path occurred. To draft for a request: find the longest suffix of the
request's last D - 1 tokens that occurs with a continuation (the match length m), then walk down
taking the most frequent continuation while the path's estimated probability (product of
count / total count of the continuations) stays >= `suffix_decoding_min_token_prob`, for at
most min(K, max_spec_factor * m + max_spec_offset) tokens. Of the two drafts the one with the
higher expected number of accepted tokens (sum of path probabilities) wins. Drafts are one chain
(no token tree).

Memory: nothing per request; the global trie has at most D nodes per output token of the
cached requests.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        self.root = _Node()
        self.max_depth = max_depth
        self.num_nodes = 0

    def add(self, tokens: list[int], active: list[_Node] | None = None) -> list[_Node]:
        """Append `tokens` to a sequence whose open suffix paths are `active` (the nodes of its
        last < D suffixes); returns the new open paths."""
        act = list(active or [])
        for t in tokens:
            act.append(self.root)
            nxt = []
            for node in act:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                nxt.append(child)
            act = nxt[-(self.max_depth - 1) :] if self.max_depth > 1 else []
        return act

    def remove(self, tokens: list[int]) -> None:
        """Subtract one sequence added earlier with `add(tokens)` (its counts; empty nodes go)."""
        d = self.max_depth
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + d]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[t]
                    break
                node = child

    def match(self, context: list[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (its last < D tokens) present in the trie,
        and that suffix's length (0: none)."""
        ctx = context[-(self.max_depth - 1) :] if self.max_depth > 1 else []
        for i in range(len(ctx)):
            node: _Node | None = self.root
            for t in ctx[i:]:
                node = node.children.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node.children:
                return node, len(ctx) - i
        return None, 0

    @staticmethod
    def speculate(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy most-frequent path below `node`: (tokens, expected accepted = sum of probs)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < max_tokens and node.children:
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            total = sum(c.count for c in node.children.values())
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            node = child
        return out, score


def _size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


def match_in_sequence(
    tokens: np.ndarray, max_depth: int, limit_of, min_prob: float
) -> tuple[list[int], float, int]:
    """The per-request trie's draft for `tokens` (its own context): (draft, expected accepted,
    match length m). `tokens`: [N] int64, the prompt and the output so far; `limit_of(m)`: the
    most draft tokens a match of length m allows."""
    n = len(tokens)
    if n < 2:
        return [], 0.0, 0
    # ends: positions e < n - 1 with tokens[e - m + 1 .. e] == the last m tokens
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    m = 1
    while ends.size and m < max_depth - 1:
        cand = ends[ends - m >= 0]
        nxt = cand[tokens[cand - m] == tokens[n - 1 - m]]
        if not nxt.size:
            break
        ends, m = nxt, m + 1
    if not ends.size:
        return [], 0.0, 0
    limit = min(limit_of(m), max_depth - m)
    out: list[int] = []
    prob, score = 1.0, 0.0
    pos = ends + 1  # where each occurrence continues
    while len(out) < limit:
        pos = pos[pos < n]
        if not pos.size:
            break
        vals, counts = np.unique(tokens[pos], return_counts=True)
        best = int(counts.argmax())
        prob *= counts[best] / pos.size
        if prob < min_prob:
            break
        tok = int(vals[best])
        out.append(tok)
        score += prob
        pos = pos[tokens[pos] == tok] + 1
    return out, score, m


class SuffixDecoder:
    """Per-request tries plus the global trie over recent outputs."""

    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.offset = max_spec_offset
        self.min_prob = min_token_prob
        self.global_trie = SuffixTrie(max_depth)
        self._cached: deque[list[int]] = deque()  # outputs in the global trie, oldest first

    def _limit(self, k: int, m: int) -> int:
        return min(k, int(self.factor * m + self.offset))

    def propose(self, req_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to k draft tokens for the request whose prompt + output so far is `tokens`."""
        arr = np.asarray(tokens, dtype=np.int64)
        own, score, _ = match_in_sequence(
            arr, self.max_depth, lambda m: self._limit(k, m), self.min_prob
        )
        node, gm = self.global_trie.match(tokens)
        if node is not None:
            draft, gscore = self.global_trie.speculate(node, self._limit(k, gm), self.min_prob)
            if gscore > score:
                return draft
        return own

    def finish(self, req_id: str, output_token_ids: list[int]) -> None:
        """The request ended: cache its output in the global trie."""
        if self.max_cached == 0 or not output_token_ids:
            return
        out = list(output_token_ids)
        self.global_trie.add(out)
        self._cached.append(out)
        while len(self._cached) > self.max_cached:
            self.global_trie.remove(self._cached.popleft())
