"""specserve: an LLM inference and serving engine built around lossless speculative decoding."""

from specserve.entrypoints.llm import LLM
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "InvalidRequestError"]
__version__ = "0.1.0"
