"""Per-request text: incremental detokenizing and stop strings (LLMEngine's output side).

Owns: `OutputState` (one per child request: the text so far, and how much of it, of its
tokens and of its logprobs was already returned) and `process_text` (the new tokens of a step
detokenized one by one; a stop string found in the new text finishes the request there).

Invariants: text is only ever returned up to `len(text) - hold` characters until the request
finishes (`hold` = the longest stop string minus one), so a stop string split across steps is
never partly sent; a request finished by a stop string keeps exactly the tokens up to the one
that completed it (several tokens can come from one speculative verify step), with their
logprobs.
"""

from __future__ import annotations

from collections.abc import Callable

from k2serve.engine.request import Request, RequestStatus
from k2serve.tokenizer.detokenizer import IncrementalDetokenizer


class OutputState:
    """Per child request: text so far and how much of it / of the tokens was already returned."""

    def __init__(self, req: Request, tokenizer) -> None:
        p = req.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, p.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.text_sent = 0
        self.tokens_sent = 0
        self.logprobs_sent = 0
        self.done_sent = False
        self.hold = max((len(s) for s in p.stop), default=1) - 1  # chars held back for stops


def process_text(
    req: Request, st: OutputState, num_new: int, finish: Callable[[Request, RequestStatus], None]
) -> int:
    """Detokenize the `num_new` new tokens one by one; a stop string found in the new text
    finishes the request (`finish`: the scheduler's finish_request, for a running one), and
    tokens after the one that completed it are dropped. Returns the number of new tokens kept."""
    if st.detok is None:
        return num_new
    toks = req.output_token_ids
    first = len(toks) - num_new
    for k in range(first, len(toks)):
        if _process_token(req, st, toks[k], k == len(toks) - 1, finish):
            if k + 1 < len(toks):
                _truncate(req, k + 1)
            return k + 1 - first
    return num_new


def _truncate(req: Request, num_output: int) -> None:
    """Keep the first `num_output` output tokens of a finished request (and their logprobs)."""
    drop = req.num_output_tokens - num_output
    del req.output_token_ids[num_output:]
    del req.all_token_ids[len(req.all_token_ids) - drop :]
    if req.logprobs is not None:
        for entry in req.logprobs[num_output:]:
            lp = next(iter(entry.values())).logprob
            req.cumulative_logprob -= lp if lp is not None else 0.0
        del req.logprobs[num_output:]


def _process_token(req: Request, st: OutputState, tok: int, last: bool, finish: Callable) -> bool:
    """Detokenize one token; True if a stop string ended the request there."""
    assert st.detok is not None
    new = st.detok.add([tok])
    if req.is_finished and last:
        new += st.detok.flush()
    if not new:
        return False
    stops = req.sampling_params.stop
    search_from = max(0, len(st.text) - st.hold)
    st.text += new
    if stops:
        hit = None
        for s in stops:
            j = st.text.find(s, search_from)
            if j >= 0 and (hit is None or j < hit[0]):
                hit = (j, s)
        if hit is not None:
            j, s = hit
            keep = j + len(s) if req.sampling_params.include_stop_str_in_output else j
            st.text = st.text[:keep]
            st.text_sent = min(st.text_sent, len(st.text))
            if not req.is_finished:
                finish(req, RequestStatus.FINISHED_STOPPED)
            else:
                req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = s
            return True
    return False
