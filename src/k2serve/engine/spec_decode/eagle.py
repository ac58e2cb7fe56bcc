"""EAGLE-3 drafting: the draft head runs after each target step, K times autoregressively.

EAGLE's alignment (as vLLM): the draft at position p reads the target's hidden state at p (the
3 auxiliary states, fused by `fc`) and the token at p + 1, and predicts the token at p + 2. So
after a step:
1. one draft forward over every position the target computed and kept this step (a prefill
   chunk, a decode's one token, a verify step's last token and accepted drafts): it writes the
   draft's KV for those positions, and at a drafting request's last position (P - 1, where P
   holds the token just sampled) gives the first draft d_0 (argmax, mapped to a target id) and
   the hidden state for the next draft step;
2. draft steps j = 2..K, one token per drafting request at position P + j - 2, each reading the
   previous step's hidden state and draft token.
The draft's KV sits in its own cache tensor indexed by the target's pages and slots (see
`model.eagle3`), so a request's pages carry both. Before step 2 each drafting request's pages
are extended to hold positions up to P + K (what the next verify step needs anyway); when pages
run out, that request gets no drafts this time.

Drafts are greedy (argmax), so the acceptance rule is the one-hot one (`verify`) and the output
distribution is exactly the target's whatever the head proposes. A request that was not
scheduled in a step (no new target hidden state) gets no drafts that step.

The target's decode CUDA graphs are captured again once the draft is loaded, so that they also
produce the auxiliary hidden states (`DecodeGraphRunner.aux`); decode + verify steps replay them
(verify tokens are one-token sequences on CUDA, see engine.runner). On CUDA the draft's
one-token steps replay CUDA graphs too (`eagle_graphs`; K2SERVE_EAGLE_GRAPHS=0: eagerly), as
does the first draft forward of a plain decode step.

Tensor parallel (engine.executor.MultiprocExecutor): the engine process is rank 0 and the head
runs there alone, replicated: after each layer's all-reduce the residual stream, so the
auxiliary states, is the whole one on every rank, and the embedding is replicated too. Its KV
cache lives on rank 0 only (indexed by the same pages); the workers never see the head, only
its drafts, in the next verify step's flat batch. The executor runs no CUDA graphs, so the
target's aux states come from eager steps and the draft runs eagerly there too.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from k2serve import envs
from k2serve.attention.base import AttentionMetadata
from k2serve.engine.input_batch import to_device
from k2serve.engine.request import Request
from k2serve.engine.spec_decode.config import SpeculativeConfig
from k2serve.engine.spec_decode.eagle_graphs import (
    EagleGraphs,
    capture_draft_graphs,
    draft_buckets,
)

logger = logging.getLogger(__name__)


def pages_with_draft(
    spec: SpeculativeConfig, cfg, target_config, kv_dtype, device, pages: int, max_model_len: int
) -> tuple[int, int]:
    """(pages, max_model_len) once the draft is given its room in the budget the target's
    pages were sized from: its KV (one page of it per target page) always, its weights too when
    the budget is the GPU's memory. An explicit --num-kv-pages is kept as given."""
    import json
    import os

    from k2serve.memory import kv_values_per_token
    from k2serve.model.eagle3 import Eagle3Config

    if cfg.num_kv_pages is not None:
        return pages, max_model_len
    assert spec.model is not None
    with open(os.path.join(spec.model, "config.json")) as f:
        c = Eagle3Config.from_hf(json.load(f))
    item = torch.empty((), dtype=kv_dtype).element_size()
    if c.kind == "llama":
        draft_token = 2 * c.num_key_value_heads * c.head_dim * item
    else:
        draft_token = (c.kv_lora_rank + c.qk_rope_head_dim) * item
    ps = cfg.page_size
    target_page = kv_values_per_token(target_config) * item * ps
    weights = 0
    if device.type == "cuda" and cfg.kv_cache_memory is None:
        files = [n for n in os.listdir(spec.model) if n.endswith(".safetensors")]
        weights = sum(os.path.getsize(os.path.join(spec.model, n)) for n in files)
    new = (pages * target_page - weights) // (target_page + draft_token * ps)
    if new * ps < max_model_len:
        if cfg.max_model_len is not None or new < 1:
            raise ValueError(
                f"with the EAGLE-3 draft ({weights / 2**30:.2f} GiB of weights, "
                f"{draft_token} bytes of KV per token) the KV cache holds {max(new, 0) * ps} "
                f"tokens < max_model_len={max_model_len}: lower --max-model-len or give more "
                "memory"
            )
        max_model_len = new * ps
    if new < pages:
        logger.info("KV cache: %d pages (of %d) after the EAGLE-3 draft's KV and weights",
                    new, pages)  # fmt: skip
    return int(new), max_model_len


class EagleProposer:
    def __init__(self, head, aux_ids, engine) -> None:
        self.head = head
        self.aux_ids = aux_ids
        self.engine = engine
        self.model = engine.model
        kv = engine.kv
        dtype = (
            engine.runner.kv_caches[0].dtype if head.config.kind == "mla" else head.fc.weight.dtype
        )
        self.kv_cache = head.new_kv_cache(kv.num_pages, kv.page_size, dtype, engine.device)
        self.graphs: EagleGraphs | None = None  # CUDA graphs of the one-token draft steps
        target = getattr(engine.runner, "graph_runner", None)
        if target is not None and engine.device.type == "cuda":
            if envs.eagle_graphs():
                buckets = draft_buckets(target.buckets, engine.config.max_num_seqs)
                self.setup_graphs(buckets, target.max_pages)
            else:
                logger.info("EAGLE-3 draft CUDA graphs: off (K2SERVE_EAGLE_GRAPHS=0)")
        tp = engine.config.tensor_parallel_size
        if tp > 1:
            logger.info(
                "EAGLE-3 at tensor_parallel_size %d: the draft head runs on rank 0 only "
                "(replicated, its KV on rank 0), eagerly (the executor captures no CUDA graphs)",
                tp,
            )

    def setup_graphs(self, buckets: tuple[int, ...], max_pages: int, graph_factory=None) -> None:
        """Capture the one-token draft steps (eagle_graphs); on failure the head stays eager."""
        emb = self.head.embed_tokens or self.model.model.embed_tokens
        self.graphs = capture_draft_graphs(self.head, emb, self.kv_cache, buckets, max_pages,
                                           graph_factory)  # fmt: skip

    @classmethod
    def load(cls, spec: SpeculativeConfig, engine) -> EagleProposer:
        from k2serve.weights.eagle3 import load_eagle3

        model = engine.model
        if not hasattr(model, "aux_hidden_state_layers"):
            raise ValueError("speculative_config: eagle3 needs the DeepSeek-V3 target model")
        assert spec.model is not None
        backend = model.model.layers[0].self_attn.backend
        head, ids = load_eagle3(spec.model, model.config, model.dtype, engine.device, backend)
        model.aux_hidden_state_layers = ids
        runner = engine.runner
        if getattr(runner, "graph_runner", None) is not None:
            # captured before the draft was known: again, now also keeping the auxiliary states
            runner.graph_runner = None
            torch.cuda.empty_cache()
            try:
                runner._setup_graphs()
            except RuntimeError as e:  # a capture that fails leaves the eager path, not a crash
                runner.graph_runner = None
                logger.warning("CUDA graphs: off with EAGLE-3 (capture failed: %s)", e)
        c = head.config
        logger.info(
            "EAGLE-3 draft: %s head (%s%s), draft vocabulary %d of %d, auxiliary target layers %s",
            c.kind, "MLA latent KV" if c.kind == "mla" else "Llama GQA KV",
            ", EAGLE3.1 norms" if c.eagle31 else "", c.draft_vocab_size, c.vocab_size, list(ids),
        )  # fmt: skip
        return cls(head, ids, engine)

    # ------------------------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.head.embed_tokens or self.model.model.embed_tokens
        return emb(ids)

    def _metadata(self, reqs: list[Request], starts: list[int], counts: list[int]):
        """Flat-batch metadata for new tokens at positions starts[b] .. + counts[b] - 1 of each
        request, over the request's own pages; (positions [T], AttentionMetadata)."""
        runner, kv = self.engine.runner, self.engine.kv
        ps = kv.page_size
        st = np.asarray(starts, dtype=np.int64)
        cnt = np.asarray(counts, dtype=np.int64)
        ends = st + cnt
        rows = [runner.block_tables.row_of(r, kv.req_pages[r.request_id], kv.req_pages)
                for r in reqs]  # fmt: skip
        table = runner.block_tables.gather(rows, -(-ends // ps))  # [B, max_pages] int32
        qsl = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum(cnt, out=qsl[1:])
        seq_of = np.repeat(np.arange(len(reqs)), cnt)
        pos = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(st - qsl[:-1], cnt)  # [T]
        slots = table[seq_of, pos // ps].astype(np.int64) * ps + pos % ps
        dev = self.engine.device
        qsl_t, sl_t, ctx_t, table_t = to_device(
            [qsl, ends.astype(np.int32), st.astype(np.int32), table], dev
        )
        pos_t, slots_t = to_device([pos, slots], dev)
        md = AttentionMetadata(
            query_start_loc=qsl_t, seq_lens=sl_t, context_lens=ctx_t, block_table=table_t,
            slot_mapping=slots_t, max_query_len=int(cnt.max()), max_seq_len=int(ends.max()),
            page_size=ps, num_decodes=int((cnt == 1).sum()),
        )  # fmt: skip
        return pos_t, md

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, reqs, starts, counts, sel=None):
        """The head over new tokens ids [T] with hidden [T, H]; at rows `sel` [A] (None: all)
        -> (draft tokens [A] as target ids, the next hidden states [A, H]). A CUDA graph when
        one fits (one token per request), else eagerly; graph outputs (when sel is None) are
        valid until the next graph run."""
        pos, md = self._metadata(reqs, starts, counts)
        if self.graphs is not None and self.graphs.fits(md):
            tok, nxt = self.graphs.run(ids, hidden, pos, md), self.graphs.hidden(ids.shape[0])
            return (tok, nxt) if sel is None else (tok[sel], nxt[sel])
        normed, nxt = self.head(self._embed(ids), hidden, pos, md, self.kv_cache)
        if sel is not None:
            normed, nxt = normed[sel], nxt[sel]
        return self.head.draft_tokens(normed), nxt

    @torch.inference_mode()
    def propose(self, want: list[tuple[Request, int]], sched) -> None:
        """Set `spec_token_ids` of each (request, k) in `want` after the step `sched`."""
        inp = self.engine.runner.last_input
        aux = self.model.aux_hidden_states  # [T, 3 * hidden] of the step just run
        if inp is None or aux is None or sched is None:
            return
        qsl, ctx = inp.query_start_loc, inp.context_lens
        # 1. the draft over every kept position of the step; decodes (1 token) first
        items = []
        for b, (req, _) in enumerate(sched.scheduled):
            if req.is_finished or req.request_id not in self.engine.kv.req_pages:
                continue
            c0 = int(ctx[b])
            valid = req.num_computed_tokens - c0  # computed and kept (not rejected drafts)
            if valid > 0:
                items.append((valid != 1, req, c0, valid, int(qsl[b])))
        if not items:
            return
        items.sort(key=lambda x: x[0])
        rows: list[int] = []
        ids: list[int] = []
        for _, req, c0, valid, q0 in items:
            rows.extend(range(q0, q0 + valid))
            ids.extend(req.all_token_ids[c0 + 1 : c0 + valid + 1])
        reqs = [x[1] for x in items]
        dev = self.engine.device
        hidden = self.head.combine_aux(aux[torch.tensor(rows, device=aux.device)])  # [T', H]
        # 2. drafting requests: the last kept row gives d_0
        want_k = {r.request_id: k for r, k in want}
        last_row: dict[str, int] = {}
        end = 0
        for _, req, _, valid, _ in items:
            end += valid
            if req.request_id in want_k:
                last_row[req.request_id] = end - 1
        kv = self.engine.kv
        active = [r for r in reqs if r.request_id in last_row
                  and kv.allocate_slots(r, 1 + want_k[r.request_id])]  # fmt: skip
        sel = torch.tensor([last_row[r.request_id] for r in active], dtype=torch.long, device=dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        tok, h = self._run(ids_t, hidden, reqs, [x[2] for x in items], [x[3] for x in items],
                           sel)  # [A] target ids, [A, H] (copies)  # fmt: skip
        if not active:
            return
        steps = [(active, tok)]  # per draft position: the requests and their tokens [A]
        for j in range(2, max(want_k[r.request_id] for r in active) + 1):
            keep = [i for i, r in enumerate(active) if want_k[r.request_id] >= j]
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                active, tok, h = [active[i] for i in keep], tok[idx], h[idx]
            positions = [r.num_tokens + j - 3 for r in active]  # P + j - 2, P = num_tokens - 1
            tok, h = self._run(tok, h, active, positions, [1] * len(active))
            tok = tok.clone()  # kept past the next step's graph replay
            steps.append((active, tok))
        drafts: dict[str, list[int]] = {r.request_id: [] for r in steps[0][0]}
        for act, t in steps:  # one host sync for all the positions
            for r, d in zip(act, t.tolist(), strict=True):
                drafts[r.request_id].append(d)
        for r, _ in want:
            r.spec_token_ids = drafts.get(r.request_id, [])

    def finish(self, req: Request) -> None:
        pass  # the draft's KV lives in the request's pages, freed with them
