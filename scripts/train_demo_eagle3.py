"""Train an EAGLE-3 draft head (Llama-layer layout) for the bundled demo, on CPU in minutes.

1. Data, as EAGLE-3 trains (self-distillation): demo conversations (k2serve.demo.conversations)
   and agent turns, rendered with the chat template, continued by the demo itself (greedy), so
   the head learns what the target says.
2. For each sequence the target's auxiliary hidden states (layers the head names) are taken
   from one forward; the head is trained to predict token p + 2 from (hidden state at p, token
   p + 1), and, as EAGLE-3's training-time test, a second pass from its own output at p - 1
   (the state it reads at draft step 2) and a third from its output of the second (step 3).
3. Written in the published layout (config.json, model.safetensors with midlayer.*, fc, norm,
   lm_head, d2t/t2d; no embed_tokens: the target's is shared) to
   src/k2serve/demo/kimi-k2-demo-eagle3, and checked: acceptance length on held-out prompts.

    .venv/bin/python scripts/train_demo_eagle3.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.nn.functional as F


def make_data(engine, n: int, seed: int) -> list[list[int]]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from spec_decode import agent_trace  # the benchmark's trace generator (other seeds)

    from k2serve.engine.sampling_params import SamplingParams

    tok = engine.tokenizer
    prompts = []
    for m, t, th in agent_trace(n, seed=seed):
        text = tok.apply_chat_template(m, tools=t, chat_template_kwargs={"thinking": th})
        prompts.append(tok.encode(text, allow_special=True))
    params = SamplingParams(temperature=0, max_tokens=96)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    return [prompts[i] + outs[str(i)] for i in range(len(prompts))]


def md_for(n: int, start: int = 0):
    from k2serve.attention.base import AttentionMetadata

    pages = -(-(start + n) // 64)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        context_lens=torch.tensor([start], dtype=torch.int32),
        block_table=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(start, start + n),
        max_query_len=n, max_seq_len=start + n, page_size=64,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from safetensors.torch import save_file

    from k2serve.demo import demo_path
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine
    from k2serve.model.eagle3 import Eagle3Config, Eagle3Head
    from k2serve.weights.eagle3 import default_aux_layer_ids, eagle3_config_dict

    out_dir = args.out or os.path.join(os.fspath(demo_path()) + "-eagle3")
    eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=1024,
                                 num_kv_pages=2048, max_num_seqs=64))  # fmt: skip
    model = eng.model
    t0 = time.time()
    seqs = make_data(eng, args.sequences, seed=1000 + args.seed)
    held = seqs[-40:]
    seqs = seqs[:-40]
    print(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens ({time.time() - t0:.0f}s)")
    d = eagle3_config_dict(model.config, "llama")
    c = Eagle3Config.from_hf(d)
    ids = default_aux_layer_ids(model.config.num_hidden_layers)
    model.aux_hidden_state_layers = ids
    aux = []
    for s in seqs:
        model(torch.tensor(s[:-1]), torch.arange(len(s) - 1))
        aux.append(model.aux_hidden_states.clone())  # [P, 3H]
    head = Eagle3Head(c, torch.float32)
    for p in head.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    with torch.no_grad():  # start the lm_head from the target's (same hidden size, full vocab)
        head.lm_head.weight.copy_(model.lm_head.weight.float())
    head.requires_grad_(True)
    head.d2t.requires_grad_(False)
    emb = model.model.embed_tokens
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.0)  # fmt: skip
    steps = args.epochs * len(seqs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps)
    kvd = (c.num_key_value_heads, c.head_dim)
    t0 = time.time()
    for ep in range(args.epochs):
        order = list(range(len(seqs)))
        random.Random(ep).shuffle(order)
        total = 0.0
        for i in order:
            s, a = seqs[i], aux[i]
            P = len(s) - 1  # positions 0 .. P - 1 have a target state and a next token
            if P < 3:
                continue
            toks = torch.tensor(s[1 : P + 1])  # token p + 1 at position p
            tgt = torch.tensor(s[2 : P + 1])  # token p + 2: positions 0 .. P - 2
            cache = torch.zeros(-(-P // 64), 64, 2, *kvd)
            x = emb(toks)
            n1, h1 = head(x, head.combine_aux(a), torch.arange(P), md_for(P), cache)
            loss = F.cross_entropy(head.lm_head(n1[: P - 1]), tgt)
            # training-time test: positions 1 .. P - 1 read the head's own state at p - 1
            cache2 = torch.zeros_like(cache)
            n2, h2 = head(x[1:], h1[:-1], torch.arange(1, P), md_for(P - 1), cache2)
            loss = loss + 0.5 * F.cross_entropy(head.lm_head(n2[: P - 2]), tgt[1:])
            if P > 3:  # and positions 2 .. P - 1 from its state two steps in (draft step 3)
                cache3 = torch.zeros_like(cache)
                n3, _ = head(x[2:], h2[:-1], torch.arange(2, P), md_for(P - 2), cache3)
                loss = loss + 0.25 * F.cross_entropy(head.lm_head(n3[: P - 3]), tgt[2:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        print(f"epoch {ep + 1}: loss {total / len(seqs):.3f} ({time.time() - t0:.0f}s)")
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16) for k, v in head.state_dict().items()
               if k != "d2t"}  # fmt: skip
    tensors["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    tensors["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)  # save_file makes it 0600
    import json

    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    # check: acceptance on held-out prompts through the engine
    spec = {"method": "eagle3", "model": out_dir, "num_speculative_tokens": 3}
    check = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=1024,
                                   num_kv_pages=2048, speculative_config=spec))  # fmt: skip
    from k2serve.engine.sampling_params import SamplingParams

    n_prompt = [len(s) for s in held]
    for i, s in enumerate(held):
        check.add_request(str(i), s[: max(8, n_prompt[i] // 2)],
                          SamplingParams(temperature=0, max_tokens=64))  # fmt: skip
    while check.has_unfinished_requests():
        check.step()
    st = check.drafter.stats
    print(
        f"wrote {out_dir}; held-out acceptance length {st.mean_acceptance_length:.2f} "
        f"(K=3, {st.num_drafts} drafts, per position {st.num_accepted_tokens_per_pos})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
