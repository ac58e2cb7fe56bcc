"""Verifying drafts: the sampler's rows for draft positions, and the acceptance rule.

A request carrying K drafts d_0..d_{K-1} is scheduled with 1 + K new tokens (its last real
token and the drafts); the runner takes logits at all 1 + K positions and hands the sampler one
row per position. Row j is the request seen with `output_token_ids + d_0..d_{j-1}` (a
`DraftRow`), so every history-dependent step of the sampler (logits processors such as the
thinking budget, penalties, min_tokens) sees exactly what it would see without speculation.

Acceptance (the standard rule of Leviathan et al. / Chen et al.): draft d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection the token is drawn from
norm(max(0, p_j - q_j)); when all K are accepted one more token is drawn from p_K. Every drafter
here proposes one token per position deterministically (n-gram, suffix, EAGLE-3 by argmax, as
vLLM v1), so q_j is one-hot at d_j and the rule becomes: accept with probability p_j(d_j); on
rejection draw from p_j with d_j removed, renormalised. That is exactly "draw x_j ~ p_j; accept
while x_j == d_j; emit x_j at the first mismatch" (P(x_j = d_j) = p_j(d_j), and x_j given
x_j != d_j is p_j restricted to the other tokens), which is what `accept` does with the samples
the sampler drew from each row. Greedy requests are the special case p_j = one-hot(argmax).
Hence the emitted tokens have exactly the target's distribution, and greedy output is token for
token the non-speculative output.
"""

from __future__ import annotations

from k2serve.engine.request import Request


class DraftRow:
    """`req` as the sampler sees it at verify position j: its output plus the drafts before j."""

    __slots__ = ("req", "extra")

    def __init__(self, req: Request, extra: list[int]) -> None:
        self.req = req
        self.extra = extra  # d_0..d_{j-1}

    def __getattr__(self, name: str):
        return getattr(self.req, name)

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.extra)

    @property
    def generator(self):
        return self.req.generator

    @generator.setter
    def generator(self, g) -> None:
        self.req.generator = g


def accept(drafts: list[int], samples: list[int]) -> int:
    """Number of drafts accepted: the longest prefix where the sample equals the draft.
    `samples` has len(drafts) + 1 entries; the emitted tokens are samples[: accepted + 1]."""
    n = 0
    for d, x in zip(drafts, samples, strict=False):
        if d != x:
            break
        n += 1
    return n
