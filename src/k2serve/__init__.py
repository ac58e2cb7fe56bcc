"""k2serve: serve the Kimi-K2 model family (DeepSeek-V3 architecture) on whatever you have."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import k2serve` (and the CLI's plan/deploy commands) do not import torch.
    if name == "LLM":
        from k2serve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from k2serve.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from k2serve.structured import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'k2serve' has no attribute {name!r}")
