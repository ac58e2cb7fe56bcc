"""Sampler on hand-made logits: each transformation checked against its definition."""

import math

import torch

from k2serve.engine.request import Request
from k2serve.engine.sampler import Sampler
from k2serve.engine.sampling_params import SamplingParams


def req(rid="r", prompt=(1, 2), out=(), eos=frozenset({0}), **kw):
    r = Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=eos, max_tokens=100)
    for t in out:
        r.append_output_token(t)
    return r


def draw(logits_row, n=3000, **kw):
    """Empirical distribution of n samples of one row (one request drawing n times)."""
    s = Sampler(seed=1)
    counts = torch.zeros(logits_row.numel())
    rows = logits_row[None].repeat(n, 1)
    reqs = [req(rid=str(i), **kw) for i in range(n)]
    toks = s(rows, reqs).token_ids
    for t in toks:
        counts[t] += 1
    return counts / n


def test_greedy_argmax_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    reqs = [req("a", temperature=0, logprobs=2), req("b", temperature=0)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == [1, 0]
    lp = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprobs[0], float(lp[1]), rel_tol=1e-6)
    assert out.ranks[0] == 1
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2]
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 2.0, 0.0, 1.5])
    freq = draw(logits, temperature=0.5)
    expect = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(freq, expect, atol=0.03)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert draw(logits, top_k=2)[2:].sum() == 0
    f = draw(logits, top_p=0.65)  # 0.4 + 0.3 >= 0.65: the first two only
    assert f[2:].sum() == 0 and f[:2].min() > 0.3
    f = draw(logits, min_p=0.6)  # keeps p >= 0.6 * 0.4 = 0.24
    assert f[2:].sum() == 0
    f = draw(logits, top_p=0.35)  # the most likely token is always kept
    assert f[0] == 1.0


def test_penalties_follow_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    s = Sampler()
    # repetition: seen tokens (prompt 1, output 0) divide positive / multiply negative logits
    r = req(prompt=[1], out=[0, 0], temperature=0, repetition_penalty=4.0, logprobs=0)
    out = s(logits, [r])
    expect = torch.tensor([0.5, -4.0, 0.5, 1.0])
    assert out.token_ids == [3]
    assert math.isclose(out.logprobs[0], float(torch.log_softmax(expect, -1)[3]), rel_tol=1e-5)
    # frequency (x count) and presence (once) on output tokens only
    r = req(prompt=[3], out=[0, 0, 2], temperature=0, frequency_penalty=0.5, presence_penalty=0.6)
    s2 = s(logits, [r])
    # 0: 2 - 1.0 - 0.6 = 0.4 ; 2: 0.5 - 0.5 - 0.6 ; 3: 1.0 untouched (prompt only)
    assert s2.token_ids == [3]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    r = req(out=[2], temperature=0, min_tokens=3, stop_token_ids=[1])
    assert Sampler()(logits, [r]).token_ids == [2]
    r = req(out=[2, 2, 2], temperature=0, min_tokens=3, stop_token_ids=[1])
    assert Sampler()(logits, [r]).token_ids == [0]


def test_logits_processor_forces_token():
    def only_two(out_ids, row):
        assert out_ids == [1]
        forced = torch.full_like(row, float("-inf"))
        forced[2] = 0.0
        return forced

    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    reqs = [
        req("a", out=[1], temperature=1.0, logits_processors=[only_two], logprobs=0),
        req("b", temperature=0),
    ]
    out = Sampler()(logits, reqs)
    assert out.token_ids == [2, 0]
    assert out.logprobs[0] == 0.0


def test_seeded_rows_ignore_batch_neighbours():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    a = req("a", temperature=1.0, seed=11)
    alone = [Sampler(seed=0)(logits[2:3], [a]).token_ids[0] for _ in range(8)]
    b = req("b", temperature=1.0, seed=11)
    others = [req(str(i), temperature=1.0) for i in range(4)]
    crowd = [Sampler(seed=99)(logits, others[:2] + [b] + others[2:]).token_ids[2] for _ in range(8)]
    assert alone == crowd and len(set(alone)) > 1


def test_callers_logits_stay_intact_and_plain_rows_match_modified_batch():
    """Rows that need no in-place change are sampled without copying the logits; rows that do
    (processors, min_tokens, penalties) work on a copy. Either way the caller's tensor is not
    changed, and a plain greedy row gives the same token alone or beside modified rows."""
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    keep = logits.clone()

    def force(ids, row):
        row = row.clone()
        row[:] = -math.inf
        row[3] = 0.0
        return row

    mixed = [
        req("a", temperature=0),
        req("b", temperature=0, logits_processors=[force]),
        req("c", temperature=0, min_tokens=5, stop_token_ids=[int(logits[2].argmax())]),
        req("d", temperature=0, presence_penalty=1.5, out=(int(logits[3].argmax()),)),
    ]
    out = Sampler()(logits, mixed).token_ids
    assert torch.equal(logits, keep)
    assert out[0] == int(keep[0].argmax()) and out[1] == 3
    assert out[2] != int(keep[2].argmax()) and out[3] != int(keep[3].argmax())
    plain = Sampler()(logits, [req(str(i), temperature=0) for i in range(4)]).token_ids
    assert torch.equal(logits, keep)
    assert plain == keep.argmax(dim=-1).tolist()


def test_static_bans_are_batched_and_equal_the_per_row_call():
    """A BanTokens processor is applied by the sampler in one write (not called);
    the tokens come out as if each row had been processed on its own."""
    from k2serve.engine.logits_processors import BanTokens

    class Counting(BanTokens):
        calls = 0

        def __call__(self, ids, row):
            Counting.calls += 1
            return super().__call__(ids, row)

    torch.manual_seed(1)
    logits = torch.randn(6, 12)
    top2 = logits.topk(2, dim=-1).indices  # [6, 2]
    reqs = []
    for i in range(6):
        kw = dict(temperature=0)
        if i % 2 == 0:
            kw["logits_processors"] = [Counting(top2[i].tolist())]
        if i == 4:
            kw.update(min_tokens=3, stop_token_ids=[int(logits[4].topk(3).indices[2])])
        reqs.append(req(str(i), **kw))
    out = Sampler()(logits, reqs).token_ids
    assert Counting.calls == 0
    for i, r in enumerate(reqs):
        row = logits[i].clone()
        for proc in r.sampling_params.logits_processors:
            row = BanTokens.__call__(proc, [], row)
        if i == 4:
            row[r.sampling_params.stop_token_ids] = -math.inf
            row[0] = -math.inf  # eos
        assert out[i] == int(row.argmax()), i
    assert out[0] not in top2[0].tolist() and out[1] == int(top2[1, 0])
