"""k2serve: serve the Kimi-K2 model family (DeepSeek-V3 architecture) on whatever you have."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__", "version_string"]


def git_revision() -> str | None:
    """The short git commit of the checkout this package runs from (plus "-dirty" with local
    changes); None when installed from a wheel or git is unavailable."""
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))  # src/k2serve -> the checkout
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None


def version_string() -> str:
    """'k2serve 0.1.0 (git 0123456789ab)' or 'k2serve 0.1.0' outside a checkout."""
    rev = git_revision()
    return f"k2serve {__version__}" + (f" (git {rev})" if rev else "")


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
