"""Structured outputs: JSON schema / regex / choice / EBNF / Kimi tool-call constraints.

`StructuredOutputsParams` (what a request asks for) -> `GrammarBackend.compile` (xgrammar) ->
one `GrammarState` per sequence, whose token bitmask the sampler applies before sampling.
`kimi.tool_call_constraint` builds the tool-call section grammar for tool_choice required / named
/ strict tools under auto.
"""

from k2serve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
