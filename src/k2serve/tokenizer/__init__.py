"""The Kimi tokenizer (tiktoken BPE + Kimi special tokens), streaming detokenizer and chat
template rendering. See kimi.py, detokenizer.py, chat_template.py, files.py."""

from k2serve.tokenizer.detokenizer import IncrementalDetokenizer
from k2serve.tokenizer.files import write_tokenizer_files
from k2serve.tokenizer.kimi import KimiTokenizer, TokenizerError

__all__ = ["IncrementalDetokenizer", "KimiTokenizer", "TokenizerError", "write_tokenizer_files"]
