"""Speculative decoding (design decision 16): drafts are another input to the same step.

- `config`: `SpeculativeConfig`, the `--speculative-config` JSON (vLLM's keys).
- `drafter`: proposes drafts after a step, turns a verify step's samples into accepted tokens,
  counts drafts / accepted tokens.
- `verify`: the sampler's view of a draft position and the acceptance rule (exact).
- `ngram`, `suffix`: model-free proposers; `eagle`: the EAGLE-3 proposer (draft head on the GPU).
"""
