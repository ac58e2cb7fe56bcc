"""The drafter: after each step it proposes draft tokens for the running requests; the next
step verifies them in the same forward as everything else (design decision 16).

Owns: which requests get drafts and how many, the model-free proposers (n-gram, suffix) and the
EAGLE-3 proposer's host side, turning a verify step's samples into accepted tokens, and the
speculative-decoding counters (vLLM's names, exported by the server's /metrics).

A request gets drafts when it is running with exactly one token to compute (it decodes), its
`SamplingParams.speculative_decoding` is true (the per-request opt-out), and no more than
`disable_by_batch_size` requests run. Its draft count is cut so that the verified tokens never
pass max_tokens or max_model_len. With a structured-output grammar the drafts are cut to the
prefix the grammar accepts (`grammar_prefix`: the matcher advances and rolls back); the sampler
masks each verify row with the matcher advanced through that row's drafts, and the request's
grammar is synced to the accepted tokens afterwards (rolled back past the rejected ones).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from k2serve.engine.request import Request, RequestStatus
from k2serve.engine.spec_decode.config import SpeculativeConfig
from k2serve.engine.spec_decode.ngram import propose_ngram
from k2serve.engine.spec_decode.verify import accept

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass
class SpecDecodingStats:
    """Totals since start (vllm:spec_decode_* counters)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def snapshot(self) -> SpecDecodingStats:
        s = dataclasses.replace(self)
        s.num_accepted_tokens_per_pos = list(self.num_accepted_tokens_per_pos)
        return s

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step of a request (1 + accepted drafts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def grammar_prefix(req: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the request's grammar accepts (its state unchanged).
    Before the constraint starts (reasoning first), drafts stop before a token that could
    start it, so that every verified row knows whether its grammar is active."""
    g = req.grammar
    g.sync(req.output_token_ids)
    if g.start is None:
        markers = {g.think_end, g.section_begin}
        n = next((j for j, t in enumerate(drafts) if t in markers), len(drafts))
        return drafts[:n]
    if g.failed:
        return []
    m, n = g.matcher, 0
    for t in drafts:
        if m.is_terminated() or not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return drafts[:n]


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> list[int]:
        return propose_ngram(req.all_token_ids, self.min_n, self.max_n, k)

    def finish(self, req: Request) -> None:
        pass  # stateless


class SuffixProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        from k2serve.engine.spec_decode.suffix import SuffixDecoder

        self.decoder = SuffixDecoder(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_max_spec_offset,
            spec.suffix_decoding_min_token_prob,
        )

    def propose(self, req: Request, k: int) -> list[int]:
        return self.decoder.propose(req.request_id, req.all_token_ids, k)

    def finish(self, req: Request) -> None:
        self.decoder.finish(req.request_id, req.output_token_ids)


def model_free_proposer(spec: SpeculativeConfig):
    if spec.method == "suffix":
        return SuffixProposer(spec)
    assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


class Drafter:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, eagle=None) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        # a model-free proposer: .propose(req, k) -> drafts, .finish(req); or the EAGLE-3
        # proposer (spec_decode.eagle.EagleProposer: .propose([(req, k)]), .finish(req))
        self.eagle = eagle
        self.proposer = None if eagle is not None else model_free_proposer(spec)
        self.stats = SpecDecodingStats(self.k)
        self._logged = (time.monotonic(), 0, 0, 0)  # time, drafts, draft tokens, accepted

    # ---- after a step: propose -------------------------------------------------------------
    def num_drafts_for(self, req: Request) -> int:
        """How many drafts `req` may carry into the next step (0: none)."""
        if req.status != RequestStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        p = req.sampling_params
        if not p.speculative_decoding:
            return 0
        # the step emits up to 1 + k tokens at positions num_tokens - 1 .. num_tokens - 1 + k
        return max(
            0, min(self.k, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens)
        )  # fmt: skip

    def propose(self, running: list[Request], sched=None) -> None:
        """Set `spec_token_ids` of every running request (empty when it gets none), after the
        step `sched` (the EAGLE-3 head reads that step's target hidden states)."""
        off = self.spec.disable_by_batch_size
        enabled = off is None or len(running) <= off
        want: list[tuple[Request, int]] = []
        for req in running:
            k = self.num_drafts_for(req) if enabled else 0
            req.spec_token_ids = []
            if k:
                want.append((req, k))
        if self.eagle is not None:  # also with no drafts wanted: the draft's KV is filled
            self.eagle.propose(want, sched)
        for req, k in want:
            if self.proposer is not None:
                req.spec_token_ids = self.proposer.propose(req, k)[:k]
            if req.grammar is not None and req.spec_token_ids:
                req.spec_token_ids = grammar_prefix(req, req.spec_token_ids)

    def finish(self, req: Request) -> None:
        """`req` ended (any way): drop its state; suffix decoding caches its output."""
        req.spec_token_ids = []
        proposer = self.eagle or self.proposer
        if proposer is not None:
            proposer.finish(req)

    # ---- after a verify step: accept ---------------------------------------------------------
    def accept(self, sample_reqs: list, token_ids: list[int]) -> tuple[dict, dict]:
        """Group the sampler's rows by request; returns ({request id: token or list of tokens
        to append}, {request id: its rows in the sampler output}). A request with drafts gets
        the list of its accepted drafts and one more sampled token."""
        rows: dict[str, list[int]] = {}
        for i, r in enumerate(sample_reqs):
            rows.setdefault(r.request_id, []).append(i)
        sampled: dict[str, int | list[int]] = {}
        for i, r in enumerate(sample_reqs):
            rid = r.request_id
            rr = rows[rid]
            if len(rr) == 1:
                sampled[rid] = token_ids[i]
            elif rr[0] == i:
                drafts = r.spec_token_ids
                samples = [token_ids[j] for j in rr]
                n = accept(drafts, samples)
                self.stats.observe(len(drafts), n)
                sampled[rid] = samples[: n + 1]
        return sampled, rows

    def maybe_log(self) -> None:
        """vLLM's periodic 'SpecDecoding metrics' line (every 10 s while drafts are verified)."""
        now = time.monotonic()
        t0, d0, dt0, a0 = self._logged
        st = self.stats
        if now - t0 < LOG_INTERVAL_S or st.num_drafts == d0:
            return
        drafts, toks, acc = (
            st.num_drafts - d0,
            st.num_draft_tokens - dt0,
            st.num_accepted_tokens - a0,
        )
        per_pos = ", ".join(f"{c / st.num_drafts:.3f}" for c in st.num_accepted_tokens_per_pos)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + acc / drafts, acc / (now - t0), toks / (now - t0), acc, toks, per_pos,
            100 * acc / toks if toks else 0.0,
        )  # fmt: skip
        self._logged = (now, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
