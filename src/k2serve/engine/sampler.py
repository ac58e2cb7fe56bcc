"""Sampling one next token per sequence from its logits row, on the logits' device.

Order of operations per row (as vLLM): logits processors -> structured-output grammar mask ->
min_tokens (EOS / stop tokens masked) -> repetition / frequency / presence penalties -> [logprobs
taken here] -> greedy argmax, or temperature -> top_k -> top_p -> min_p -> sample.

Structured outputs: the rows whose request has an active grammar get one bitmask filled on the
host (xgrammar, all rows at once), copied to the logits' device without blocking and applied in
place by xgrammar's kernel, so the mask adds no host sync to the step. When min_tokens would ban
every token the grammar allows (the grammar is complete and only EOS remains), the grammar wins.
A constraint that has not started yet (thinking on, the reply still reasoning) bans EOS and the
stop tokens like min_tokens does, so the turn cannot end before the constrained part.

A `logits_processors.BanTokens` (a history-independent ban) is not called: the sampler sets
those tokens to -inf for all rows in one indexed write, and the min_tokens bans in another
after the grammar mask (a per-row call would cost a few device ops per request per step).

Logprobs are those of the processed logits before temperature (so a token forced by a logits
processor has a finite logprob), as `Logprob(logprob, rank)` with rank 1 = most likely.

Reproducibility: a seeded request draws its noise from its own `torch.Generator` (seed + sample
index), one draw per generated token, so its tokens do not depend on which other requests share
the batch. Unseeded requests share the sampler's generator (seeded by `EngineConfig.seed`).
Sampling uses the exponential-race trick: argmax(p / q), q ~ Exp(1), which equals sampling
from p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k2serve.engine.logits_processors import BanTokens
from k2serve.engine.request import Request
from k2serve.kernels.cpu.logits import cpu_argmax


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # logprob of the sampled token (None if not requested)
    ranks: list[int | None]
    top_logprobs: list[list[tuple[int, float]] | None]  # top tokens, most likely first
    token_ids_t: torch.Tensor | None = None  # [B] long on the logits' device (async scheduling)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A device->host copy into a fresh pinned tensor, queued without blocking (the caching
    host allocator keeps the block until the copy is done)."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


class PendingSample:
    """A step's samples on the device, on their way to the host: `token_ids_t` feeds the next
    step's placeholders on the device; `result()` waits for the copies (the step's one
    device->host sync) and returns the SamplerOutput.

    Deferred (CUDA): the tokens (and the logprob tensors) are copied into fresh pinned host
    tensors without blocking, right behind the sampler's kernels, and an event is recorded; so
    the wait in `result()` ends when this step's work is done, not when work queued after it is
    (a plain `.tolist()` would sync the stream, queued next step included)."""

    __slots__ = ("token_ids_t", "_host", "_event", "_nlp")

    def __init__(self, tokens: torch.Tensor, lp, nlp: list[int | None], defer: bool) -> None:
        self.token_ids_t = tokens
        self._nlp = nlp  # each row's logprobs request (None: none)
        host = [tokens] if lp is None else [tokens, lp[0], lp[1], *(lp[2] or ())]
        self._event = None
        if defer and tokens.is_cuda:
            host = [_pinned_copy(t) for t in host]
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = host

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()  # releases the GIL while it waits
        host = self._host
        token_list = host[0].tolist()
        num_rows = len(token_list)
        out = SamplerOutput(
            token_list, [None] * num_rows, [None] * num_rows, [None] * num_rows,
            self.token_ids_t,
        )  # fmt: skip
        if len(host) > 1:
            chosen_l, ranks_l = host[1].tolist(), host[2].tolist()
            top_vl, top_il = (host[3].tolist(), host[4].tolist()) if len(host) > 3 else ([], [])
            for i, n in enumerate(self._nlp):
                if n is None:
                    continue
                out.logprobs[i], out.ranks[i] = chosen_l[i], ranks_l[i]
                out.top_logprobs[i] = (
                    list(zip(top_il[i][:n], top_vl[i][:n], strict=True)) if n else []
                )
        return out


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._bitmask: torch.Tensor | None = None  # host [rows, words] int32, reused
        # async scheduling: called once the step's device work is queued, before the host sync
        self.on_launched: Any = None

    def _apply_grammars(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """Mask the rows of requests with an active grammar; returns those rows."""
        rows: list[int] = []
        matchers: list = []
        backend: Any = None  # the grammar backend of the constrained rows
        bm = None
        # spec decode: a request verifying drafts has one row per draft position, all with the
        # same matcher; each such row is synced to its own history and filled on its own
        counts: dict[int, int] = {}
        for r in reqs:
            if r.grammar is not None:
                counts[id(r.grammar)] = counts.get(id(r.grammar), 0) + 1
        num_rows = logits.shape[0]
        own_rows: list[int] = []
        for i, r in enumerate(reqs):
            g = r.grammar
            if g is None:
                continue
            g.sync(r.output_token_ids)  # no-op unless the outputs changed outside the engine
            if not g.active:
                continue
            backend = g.backend
            if counts[id(g)] == 1:
                rows.append(i)
                matchers.append(g.matcher)
                continue
            if bm is None:
                bm = self._bitmask_for(backend, num_rows)
            backend.fill_bitmask([g.matcher], bm, [i])
            own_rows.append(i)
        if not rows and not own_rows:
            return rows
        if bm is None:
            bm = self._bitmask_for(backend, num_rows)
        if rows:
            backend.fill_bitmask(matchers, bm, rows)
        rows = sorted(rows + own_rows)
        dev_bm = bm[:num_rows].to(self.device, non_blocking=True)  # [B, words]
        backend.apply_bitmask(logits, dev_bm, rows)
        return rows

    def _bitmask_for(self, backend, num_rows: int) -> torch.Tensor:
        bm = self._bitmask
        if bm is None or bm.shape[0] < num_rows or bm.shape[1] * 32 < backend.vocab_size:
            # NOTE: reusing a pinned buffer is safe: each step ends with the sampled tokens
            # copied to the host, after which the previous copy has completed.
            bm = backend.allocate_bitmask(max(num_rows, 8), pin=self.device.type == "cuda")
            self._bitmask = bm
        return bm

    @staticmethod
    def _ban(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
        """logits[rows[k], cols[k]] = -inf for all k, in one indexed write."""
        if not rows:
            return
        idx = torch.tensor([rows, cols], dtype=torch.long)  # [2, K]
        if logits.is_cuda:
            idx = idx.pin_memory().to(logits.device, non_blocking=True)
        logits[idx[0], idx[1]] = float("-inf")

    def _generator(self, req: Request) -> torch.Generator:
        if req.generator is None:
            g = torch.Generator(device=self.device)
            seed = req.sampling_params.seed
            assert seed is not None  # requests without a seed use the shared generator
            g.manual_seed(int(seed) + req.index)
            req.generator = g
        return req.generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits: [B, vocab] float32, row i belongs to reqs[i] -> the samples on the host."""
        return self.launch(logits, reqs, defer=False).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, reqs: list[Request], defer: bool) -> PendingSample:
        """The samples' device work and their device->host copies; defer: the copies do not
        block (PendingSample; the async worker launches the next step before it waits)."""
        num_rows, vocab = logits.shape
        assert num_rows == len(reqs)
        params = [r.sampling_params for r in reqs]
        # NOTE: copy only when rows are modified in place below (the caller's tensor stays intact)
        modifies = any(
            p.logits_processors
            or p.needs_penalties
            or r.num_output_tokens < p.min_tokens
            or r.grammar is not None
            for r, p in zip(reqs, params, strict=True)
        )
        logits = logits.float().clone() if modifies else logits.float()

        ban_rows: list[int] = []  # (row, token) pairs set to -inf in one indexed write
        ban_cols: list[int] = []
        for i, (r, p) in enumerate(zip(reqs, params, strict=True) if modifies else ()):
            for proc in p.logits_processors:
                if isinstance(proc, BanTokens):  # a history-independent ban: batched below
                    ban_cols.extend(proc.token_ids)
                    ban_rows.extend([i] * len(proc.token_ids))
                    continue
                logits[i] = proc(list(r.output_token_ids), logits[i])
        # NOTE: the processors' bans land before the grammar mask, the min_tokens bans after,
        # as in the per-row order; a ban is final either way (no processor turns -inf finite)
        self._ban(logits, ban_rows, ban_cols)
        grammar_rows = set(self._apply_grammars(logits, reqs)) if modifies else set()
        ban_rows, ban_cols = [], []
        for i, (r, p) in enumerate(zip(reqs, params, strict=True) if modifies else ()):
            # a pending constraint (still reasoning) must not be skipped by ending the turn
            pending = r.grammar is not None and r.grammar.pending
            if r.num_output_tokens < p.min_tokens or pending:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned += list(r.eos_token_ids)
                banned = [t for t in banned if t < vocab]
                if banned and i in grammar_rows:
                    row = logits[i].clone()
                    row[banned] = float("-inf")
                    # [vocab]: keep the grammar's choice when the ban would leave no token
                    logits[i] = torch.where(torch.isinf(row).all(), logits[i], row)
                elif banned:
                    ban_cols.extend(banned)
                    ban_rows.extend([i] * len(banned))
        self._ban(logits, ban_rows, ban_cols)

        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if pen_rows:
            self._apply_penalties(logits, [reqs[i] for i in pen_rows], pen_rows)

        want_lp = [p.logprobs is not None for p in params]
        logp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None  # [B, vocab]

        greedy = [p.greedy for p in params]  # decided on the host: no device sync
        # [B]; CPU decode rows: on the calling thread (torch's argmax woke its OpenMP team)
        tokens = cpu_argmax(logits)
        if tokens is None:
            tokens = logits.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(logits, reqs, params)
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, sampled)

        lp = None
        if logp is not None:
            chosen = logp.gather(1, tokens[:, None])[:, 0]  # [B]
            ranks = (logp > chosen[:, None]).sum(dim=-1) + 1  # [B]
            k = max(p.logprobs or 0 for p in params)
            top = logp.topk(k, dim=-1) if k else None  # ([B, k], [B, k])
            lp = (chosen, ranks, top)
        pending = PendingSample(tokens, lp, [p.logprobs for p in params], defer)
        if self.on_launched is not None:
            self.on_launched()
        return pending

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
        vocab = logits.shape[1]
        dev = logits.device
        for row, r in zip(rows, reqs, strict=True):
            p = r.sampling_params
            out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
            counts = torch.zeros(vocab, device=dev)  # [vocab]
            if out_ids.numel():
                counts.scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
            x = logits[row]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt_ids = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)
                seen[prompt_ids[prompt_ids < vocab]] = True
                rp = p.repetition_penalty
                x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            logits[row] = x

    def _sample(self, logits: torch.Tensor, reqs: list[Request], params) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)
        x = logits / temp[:, None]  # [B, vocab]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(top_k) or any(tp < 1 for tp in top_p):
            vals, idx = x.sort(dim=-1, descending=True)  # [B, vocab]
            mask = torch.zeros_like(vals, dtype=torch.bool)
            if any(top_k):
                k = torch.tensor([k or x.shape[1] for k in top_k], device=dev)
                mask |= torch.arange(x.shape[1], device=dev)[None, :] >= k[:, None]
            if any(tp < 1 for tp in top_p):
                probs = torch.softmax(vals.masked_fill(mask, float("-inf")), dim=-1)
                before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
                mask |= before > torch.tensor(top_p, device=dev)[:, None]
            vals = vals.masked_fill(mask, float("-inf"))
            x = torch.empty_like(x).scatter_(1, idx, vals)
        probs = torch.softmax(x, dim=-1)  # [B, vocab]
        if any(min_p):
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True)[0]
            probs = probs.masked_fill(probs < thresh, 0.0)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None and not params[i].greedy:
                q[i].exponential_(generator=self._generator(r))
        return (probs / q).argmax(dim=-1)
