"""The Kimi-K2 / DeepSeek-V3 model."""

from k2serve.model.deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3ForCausalLM"]
