"""The runner's host-side batch building: persistent block tables and packed device copies."""

import random

import numpy as np
import torch

from k2serve.engine.input_batch import BlockTables, pack, to_device, unpack


class _Req:
    def __init__(self, rid: str) -> None:
        self.request_id = rid


def test_block_tables_follow_page_lists_through_growth_preemption_and_reuse():
    """Random life of many requests (pages appended, lists freed and reallocated, ids reused,
    more live requests than rows, longer tables than the width): every gather equals the page
    lists read directly, padded with page 0."""
    rng = random.Random(0)
    bt = BlockTables(num_rows=4, width=2)  # both must grow
    req_pages: dict[str, list[int]] = {}
    reqs: dict[str, _Req] = {}
    next_page = 1
    for _ in range(400):
        op = rng.random()
        rid = f"r{rng.randrange(12)}"
        if rid not in req_pages or op < 0.1:  # new request (or an id reused after finishing)
            reqs[rid] = _Req(rid)
            req_pages[rid] = []
        elif op < 0.2:  # preempted: pages freed, a new list allocated later
            req_pages[rid] = []
        elif op < 0.3:
            del req_pages[rid]  # finished
            continue
        for _ in range(rng.randrange(3)):
            req_pages[rid].append(next_page)
            next_page += 1
        live = [r for r in req_pages if req_pages[r]]
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))
        rows = [bt.row_of(reqs[r], req_pages[r], req_pages) for r in batch]
        assert len(set(rows)) == len(rows)
        need = np.array([rng.randint(1, len(req_pages[r])) for r in batch])
        got = bt.gather(rows, need)
        want = np.zeros((len(batch), need.max()), dtype=np.int32)
        for b, r in enumerate(batch):
            want[b, : need[b]] = req_pages[r][: need[b]]
        np.testing.assert_array_equal(got, want)


def test_pack_aligns_and_round_trips():
    arrays = [
        np.arange(5, dtype=np.int32),
        np.arange(12, dtype=np.int32).reshape(3, 4) + 100,
        np.array([7], dtype=np.int32),
    ]
    packed, offsets = pack(arrays)
    assert all(off * 4 % 16 == 0 for off in offsets)
    views = unpack(torch.from_numpy(packed), offsets, arrays)
    for a, v in zip(arrays, views, strict=True):
        assert v.shape == a.shape and v.dtype == torch.int32
        np.testing.assert_array_equal(v.numpy(), a)
    on_cpu = to_device(arrays, torch.device("cpu"))
    for a, v in zip(arrays, on_cpu, strict=True):
        np.testing.assert_array_equal(v.numpy(), a)
