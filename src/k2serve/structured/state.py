"""One sequence's grammar state: its matcher and where the constraint starts in its output.

Owns: `GrammarState`, kept on the `Request` (one per sequence, so `n > 1` has one matcher per
sample), synced with the request's output tokens.

Invariants:
- The state is a function of `output_token_ids` alone: `sync(output)` feeds the matcher the
  tokens it has not seen, rolls it back when the output is shorter than what it consumed, and
  rebuilds it when the output no longer reaches the constraint's start. So preemption
  (recompute keeps the outputs), cancellation (the request and its matcher are dropped) and any
  replay leave no stale state, and nothing is registered anywhere else.
- Thinking: with `after_reasoning` the constraint starts after the first `</think>` of the
  output (or at a `<|tool_calls_section_begin|>` written while reasoning, with
  `open_on_tool_section`); until then the sequence is unconstrained.
- `pending`: the constraint has not started (still reasoning); the sampler bans EOS and the
  stop tokens meanwhile and `Request.check_stop_token` does not stop on them, so a reply cannot
  end inside its reasoning and skip the constraint.
- `terminated`: the grammar accepted a stop token (or can accept nothing more); the request
  ends with finish_reason "stop". `failed`: a token the grammar rejects was appended (a mask
  overridden, or a grammar with a dead end); the request ends with finish_reason "abort" (its
  text is not valid for the constraint), and the error is logged.
"""

from __future__ import annotations

import logging

from k2serve.parsers.markers import SECTION_BEGIN, THINK_END
from k2serve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, backend, compiled, params: StructuredOutputsParams) -> None:
        self.backend = backend
        self.compiled = compiled
        self.matcher = backend.matcher(compiled)
        self.after_reasoning = params.after_reasoning
        self.think_end = backend.marker_id(THINK_END) if params.after_reasoning else None
        self.section_begin = (
            backend.marker_id(SECTION_BEGIN) if params.open_on_tool_section else None
        )
        self._reset()

    def _reset(self) -> None:
        self.start: int | None = None if self.after_reasoning else 0
        self.num_scanned = 0  # output tokens looked at while waiting for the start
        self.num_accepted = 0  # tokens from `start` on that the matcher consumed
        self.failed = False

    def sync(self, output: list[int]) -> None:
        if len(output) < (self.start if self.start is not None else self.num_scanned):
            self.matcher.reset()
            self._reset()
        if self.start is None:
            for i in range(self.num_scanned, len(output)):
                t = output[i]
                if t == self.think_end:
                    self.start = i + 1
                    break
                if t == self.section_begin:
                    self.start = i
                    break
            else:
                self.num_scanned = len(output)
                return
        have = len(output) - self.start
        if have < self.num_accepted:
            self.matcher.rollback(self.num_accepted - have)
            self.num_accepted = have
            self.failed = False
        if self.failed:
            return
        for t in output[self.start + self.num_accepted :]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                self.failed = True
                logger.error("grammar rejected token %d after %d tokens", t, self.num_accepted)
                return
            self.num_accepted += 1

    @property
    def active(self) -> bool:
        """Whether the next token must follow the grammar."""
        return self.start is not None and not self.failed and not self.matcher.is_terminated()

    @property
    def pending(self) -> bool:
        """The constraint has not started yet (thinking on, still reasoning): the turn must not
        end here, or the constrained part would be skipped (the engine bans the end-of-turn
        tokens until it starts; the request may still finish "length")."""
        return self.start is None

    @property
    def terminated(self) -> bool:
        return self.start is not None and self.matcher.is_terminated()

    @property
    def finished(self) -> bool:
        return self.failed or self.terminated
