"""specdecode: speculative decoding for Llama/Qwen2-family models."""

from specdecode import cpu_isa

cpu_isa.cap_torch()  # before anything imports torch: SPECDECODE_ISA caps torch's kernels too

from specdecode.config import SpeculativeConfig  # noqa: E402
from specdecode.engine.llm import LLM  # noqa: E402
from specdecode.engine.sequence import CompletionOutput, RequestOutput  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from specdecode.structured import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StructuredOutputsParams"]
__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it statically (without importing the package), and
`specdecode --version`, both HTTP apps (`/version` too) and the benchmark's records show it."""
