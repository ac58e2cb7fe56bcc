"""Test doubles for the engine: a fake model whose next-token logits are a deterministic function
of the whole token history, read back from the PAGED KV cache (so a wrong slot_mapping, block
table, prefix-cache hit or preemption shows up as a wrong token), and a tiny fake tokenizer.

`reference_logits(tokens)` computes the same logits directly from a token list: the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M = 1_000_003
VOCAB = 64
EOS = 0


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = (EOS,)
    num_hidden_layers: int = 1
    kv_cache_dim: int = 2


def _weights(n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.int64)
    return (j * 7919 + 13) % M


def _logits_from_hash(h: torch.Tensor) -> torch.Tensor:
    # h: [S] int64 -> [S, VOCAB] float32 in [0, 8)
    v = torch.arange(VOCAB, dtype=torch.int64)
    x = (h[:, None] * (v[None, :] + 1) * 2654435761 + v[None, :] * 97) % 10007
    return x.float() / 10007 * 8.0


def history_hash(tokens: list[int]) -> int:
    t = torch.tensor(tokens, dtype=torch.int64)
    return int(((t + 1) * _weights(len(tokens))).sum() % M)


def reference_logits(tokens: list[int]) -> torch.Tensor:
    return _logits_from_hash(torch.tensor([history_hash(tokens)]))[0]


def reference_greedy(prompt: list[int], max_tokens: int, eos: bool = True) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(reference_logits(toks).argmax())
        out.append(t)
        toks.append(t)
        if eos and t == EOS:
            break
    return out


class FakeModel:
    """The runtime's model interface (`install_backends`, `moe_blocks`, `device`, forward and
    `compute_logits`) around the history-hash oracle."""

    device = torch.device("cpu")
    decode_graph_safe = False
    expert_placement = None

    def __init__(self) -> None:
        self.config = FakeConfig()
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.fail_at_call: int | None = None  # raise on this call (engine failure tests)

    def __call__(self, input_ids, positions, attn_metadata=None, kv_caches=None):
        md = attn_metadata
        if self.calls == self.fail_at_call:
            raise RuntimeError("device fell over")
        self.calls += 1
        self.batch_sizes.append(int(md.seq_lens.numel()))
        cache = kv_caches[0].view(-1, 2)  # [num_pages * page_size, 2]
        cache[md.slot_mapping, 0] = input_ids.float()
        cache[md.slot_mapping, 1] = positions.float()
        ps = md.page_size
        qsl = md.query_start_loc.tolist()
        hidden = torch.empty(input_ids.numel(), 1, dtype=torch.int64)
        for b in range(md.seq_lens.numel()):
            seq_len, ctx = int(md.seq_lens[b]), int(md.context_lens[b])
            assert qsl[b + 1] - qsl[b] == seq_len - ctx
            if b < md.num_decodes:
                assert seq_len - ctx == 1
            pos = torch.arange(seq_len)
            slots = md.block_table[b, pos // ps].long() * ps + pos % ps
            toks = cache[slots, 0].long()
            assert torch.equal(cache[slots, 1].long(), pos), "paged cache holds wrong positions"
            cum = ((toks + 1) * _weights(seq_len)).cumsum(0) % M  # [seq_len]
            hidden[qsl[b] : qsl[b + 1], 0] = cum[ctx:seq_len]
            assert torch.equal(positions[qsl[b] : qsl[b + 1]], pos[ctx:seq_len])
        return hidden

    def compute_logits(self, hidden):
        return _logits_from_hash(hidden[:, 0])

    def install_backends(self, attention, experts, triton_norm, policy, placement=None) -> str:
        return ""  # it reads its cache itself: nothing to wire

    def moe_blocks(self) -> list:
        return []

    def parameters(self) -> list:
        return []  # no weights: the dtype comes from the config / the device


def fake_kv_caches(num_pages, page_size, dtype, device):
    return [torch.full((num_pages, page_size, 2), -1.0)]


class FakeTokenizer:
    """Token v -> two letters; token 0 is the special EOS '<eos>'."""

    eos_token_id = EOS

    def piece(self, v: int) -> str:
        if v == EOS:
            return "<eos>"
        return chr(ord("a") + v % 26) + chr(ord("a") + (v * 7) % 26)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.piece(i) for i in ids if not (skip_special_tokens and i == EOS))

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        return self.decode(ids, skip_special_tokens).encode()

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        # only used for prompts in tests: one token per character
        return [1 + (ord(c) % (VOCAB - 1)) for c in text]

    def token_to_id(self, s: str) -> int:
        raise KeyError(s)
