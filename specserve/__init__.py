"""specserve: an LLM inference and serving engine built around lossless speculative decoding."""

from specserve.isa import apply_isa_cap

apply_isa_cap()  # before torch starts oneDNN: a CPU advertising AMX it cannot run must not SIGILL

from specserve.entrypoints.llm import LLM  # noqa: E402
from specserve.errors import InvalidRequestError  # noqa: E402
from specserve.outputs import RequestOutput  # noqa: E402
from specserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "InvalidRequestError"]
__version__ = "0.1.0"
