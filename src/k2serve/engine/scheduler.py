"""Continuous-batching scheduler with one token budget per step (the vLLM v1 rule).

There is no prefill or decode phase. Each request has `num_computed_tokens` and `num_tokens`;
each step hands out at most `max_num_batched_tokens` new tokens over at most `max_num_seqs`
sequences: running decodes first (1 token each), then running unfinished prefills (the rest of
the prompt or what is left of the budget), then waiting requests FCFS (after a prefix-cache
lookup). In the flat batch the one-token sequences (decodes) come first.

When pages run out for a running request, the most recently admitted running request is
preempted (un-scheduled if it was already given tokens this step): its pages are freed and it
goes back to the front of the waiting queue, by recompute, or, with a host KV tier that has
room, swapped out to host RAM and back. A step that preempted admits no waiting request.

Host KV tier (k2serve.cache.host_tier): a waiting request whose prefix continues in host RAM,
or a swapped-out one, is admitted with its pages copied in during this step; it computes in
this step if the copy is small, else from the first step after the copy is done (the copy
overlaps compute; no step waits for it). `SchedulerOutput.transfers` carries the step's
copies to the runner.

Async scheduling (engine.pipeline; `schedule(async_step=True)`): the step is scheduled while
the previous one is still computing. A request the previous step samples has a placeholder for
that token (`Request.num_output_placeholders`, counted in `num_tokens`), so it is scheduled for
its next decode now; the runner fills the token in from the previous step's samples. The
scheduled requests' `num_computed_tokens` move once the batch is prepared (`advance_async`: the
step in flight computes them), and `update_from_output` then only turns placeholders into
tokens. A request whose placeholders will reach max_tokens is not scheduled again (it is
certain to finish). A request that turns out finished by the previous step's token had one
more token scheduled: the step computes it into its pages and the token is dropped. Its pages
may be freed and handed to other requests while that step is in flight, which is safe because
steps run in order on one stream: any later use of a page runs after the step that writes it.

Invariants:
- Every request that leaves (finished, aborted, preempted) returns all its pages.
- A request is in exactly one of `waiting` / `running`, or in neither once finished.
- Given the engine's admission check (each request fits the whole cache alone), the oldest
  running request can always make progress, so scheduling never deadlocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from k2serve.cache.host_tier import KVTransfers
from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, number of new tokens to compute), one-token sequences first
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    async_step: bool = False  # scheduled ahead (placeholders; see the module docstring)
    transfers: KVTransfers | None = None  # host KV tier copies, run before this step's forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted, at any moment) and free its pages."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)

    def next_step_is_full(self) -> bool:
        """Whether the next step is filled without new arrivals: the running requests are at
        max_num_seqs, or the waiting ones' prompt tokens (with one token per running request)
        fill the step's token budget. Async scheduling then schedules at once: waiting for
        requests to arrive could not put them into that step."""
        if len(self.running) >= self.max_num_seqs:
            return True
        room = self.max_num_batched_tokens - len(self.running)
        for req in self.waiting:
            room -= req.num_tokens - req.num_computed_tokens
            if room <= 0:
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, async_step: bool = False) -> SchedulerOutput:
        """`async_step`: schedule while the previous step is in flight (module docstring)."""
        out = SchedulerOutput(async_step=async_step)
        budget = self.max_num_batched_tokens
        self.kv.begin_step()  # K2 host tier: restored pages whose copy is done get cached

        # decodes first (a decode never waits behind another request's long prefill chunk),
        # then unfinished prefills, each in running order
        queue = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        queue += [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        chosen: dict[str, tuple[Request, int]] = {}
        for req in queue:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self.kv.ready(req):
                continue  # K2 host tier: its pages are still being copied in
            if (
                req.num_output_placeholders
                and req.num_output_tokens + req.num_output_placeholders >= req.max_tokens
            ):
                continue  # async: the token in flight is its last
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new == 1 and req.spec_token_ids:  # spec decode: verify the drafts too
                num_new += len(req.spec_token_ids)
            num_new = min(num_new, budget)
            assert num_new > 0, req
            while not self.kv.allocate_slots(req, num_new):
                # preempt the most recently admitted request (un-scheduling it if needed)
                victim = self.running.pop()
                if victim.request_id in chosen:
                    budget += chosen.pop(victim.request_id)[1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                chosen[req.request_id] = (req, num_new)
                budget -= num_new
                if req.spec_token_ids:  # the drafts that fit this step's budget
                    del req.spec_token_ids[num_new - 1 :]
        scheduled: list[tuple[Request, int]] = list(chosen.values())

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                assert req.num_output_placeholders == 0, req  # async: resolved before admission
                # K2 host tier: a swapped-out request comes back, a prefix may continue in RAM
                swapped = self.kv.is_swapped(req)
                fresh = req.num_computed_tokens == 0
                hit_pages = self.kv.get_computed_pages(req) if fresh else []
                host_hits = self.kv.get_host_hits(req, len(hit_pages)) if fresh else []
                num_hit = len(hit_pages) + len(host_hits)
                num_computed = req.num_computed_tokens + num_hit * self.kv.page_size
                num_new = req.num_tokens - num_computed
                if num_new > budget:
                    if not self.enable_chunked_prefill and req.num_output_tokens == 0:
                        break
                    num_new = budget
                if swapped:
                    ok = self.kv.swap_in(req, num_new)
                elif host_hits:
                    ok = self.kv.load_prefix(req, num_new, hit_pages, host_hits)
                else:
                    ok = self.kv.allocate_slots(req, num_new, hit_pages)
                if not ok:
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_computed
                    self.kv.prefix_query_tokens += req.num_tokens
                    self.kv.prefix_hit_tokens += num_computed
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_computed
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if not self.kv.ready(req):
                    continue  # K2 host tier: a large copy in: it computes once it is done
                scheduled.append((req, num_new))
                budget -= num_new

        decodes = [s for s in scheduled if s[1] == 1]
        # spec decode: requests verifying drafts right after the decodes (then prefills)
        verify = [s for s in scheduled if s[1] != 1 and s[0].spec_token_ids]
        rest = [s for s in scheduled if s[1] != 1 and not s[0].spec_token_ids]
        out.scheduled = decodes + verify + rest
        out.num_decodes = len(decodes)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.transfers = self.kv.take_transfers()
        return out

    def advance_async(self, out: SchedulerOutput) -> None:
        """Async scheduling, once the step's batch is prepared: its tokens count as computed
        (the step in flight computes them) and each request it samples gets a placeholder."""
        assert out.async_step
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                req.num_output_placeholders += 1  # its pages are cached once the token is in
            else:  # a prompt chunk: its full pages can be hit from the next step on
                self.kv.cache_computed_pages(req)

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []  # drafts are proposed again after the next step
        if not self.kv.swap_out(req):  # K2 host tier: swap when it has room, else recompute
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> list[Request]:
        """Advance the scheduled requests by their computed tokens and append sampled tokens.

        `sampled` maps request id -> new token for the requests that sampled, or -> a list of
        tokens for a request that verified drafts (its accepted drafts and one more token).
        Returns the requests that got new tokens (finished ones already removed and their
        pages freed).
        """
        if out.async_step:
            return self._update_async(out, sampled)
        updated = []
        for req, num_new in out.scheduled:
            tok = sampled.get(req.request_id)
            if isinstance(tok, list):  # spec decode: see _append_verified
                self._append_verified(req, tok)
                updated.append(req)
                continue
            req.num_computed_tokens += num_new
            self.kv.cache_computed_pages(req)
            if tok is None:
                continue
            assert req.num_computed_tokens == req.num_tokens, req
            self._append_token(req, tok)
            updated.append(req)
        return updated

    def _update_async(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]):
        """update_from_output of a step scheduled ahead: its tokens were counted as computed
        at scheduling time, so only the placeholders become tokens. A request finished since
        (aborted, or ended by the previous step's token) drops its token; one preempted since
        (waiting, no pages) keeps it, as it would have had it before being preempted."""
        updated = []
        for req, _ in out.scheduled:
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            assert not isinstance(tok, list), "speculative decoding steps run synchronously"
            req.num_output_placeholders -= 1
            if req.is_finished:
                continue
            self._append_token(req, tok)
            updated.append(req)
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_computed_pages(req)
        return updated

    def _append_token(self, req: Request, tok: int) -> bool:
        """Append one sampled token; finish the request if it ends there (EOS, stop token,
        max_tokens). -> whether it finished."""
        req.append_output_token(tok)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        status = req.status  # RUNNING, or PREEMPTED (async: preempted after the step ran)
        if not req.check_stop_token():
            return False
        status, req.status = req.status, status
        self.finish_request(req, status)
        return True

    def _append_verified(self, req: Request, tokens: list[int]) -> None:
        """A verify step computed the KV of the last token and of the drafts; the first
        len(tokens) - 1 drafts were accepted, so the KV of the last token and of those drafts is
        valid (num_computed_tokens moves by len(tokens)); the rejected drafts' slots lie beyond
        and are overwritten by the next step. Tokens are appended one by one, stopping where
        the request ends (EOS, stop token, max_tokens) exactly as without drafts."""
        req.spec_token_ids = []
        req.num_computed_tokens += len(tokens)
        for t in tokens:
            if self._append_token(req, t):
                return
        assert req.num_computed_tokens == req.num_tokens - 1, req
        self.kv.cache_computed_pages(req)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        if len(ids) != len(set(ids)):
            raise AssertionError("a request is queued twice")
        swapped = self.kv.host.swapped if self.kv.host is not None else {}
        if not set(swapped) <= {r.request_id for r in self.waiting}:
            raise AssertionError(f"host pages held by requests not waiting: {set(swapped)}")
        for r in self.waiting:
            if self.kv.num_pages_of(r):
                raise AssertionError(f"waiting {r} holds pages")
        held = set(self.kv.req_pages)
        if not held <= {r.request_id for r in self.running}:
            raise AssertionError(f"pages held by requests not running: {held}")
