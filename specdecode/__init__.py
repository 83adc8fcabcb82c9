"""specdecode: speculative decoding for Llama/Qwen2-family models."""

from specdecode.config import SpeculativeConfig
from specdecode.engine.llm import LLM
from specdecode.engine.sequence import CompletionOutput, RequestOutput
from specdecode.sampling import SamplingParams
from specdecode.structured import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StructuredOutputsParams"]
__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it statically (without importing the package), and
`specdecode --version`, both HTTP apps (`/version` too) and the benchmark's records show it."""
