"""pdserve: LLM serving with disaggregated prefill and decode, and a vLLM-compatible API.

The public names load lazily, so light processes (the router) that import a submodule such as
`pdserve.block_hash` do not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
import os

# pdserve processes start children with fork + exec (pdserve up, Cluster) and never use gRPC
# in a forked child. gRPC's fork support restarts its poller in the child, which can abort
# there before exec ("epoll_wait error: Bad file descriptor", grpc/grpc#43055). Read when
# gRPC initialises, so this must come before the first `import grpc`; a user's setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# OpenMP's barrier spin and wait policy (cpu_budget.py), read when torch loads libgomp, so they
# too must come first. A user's settings win.
from pdserve.cpu_budget import set_openmp_defaults  # noqa: E402 - light: no torch

set_openmp_defaults()

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "EngineArgs": "pdserve.engine.engine_args",
    "SamplingParams": "pdserve.sampling_params",
    "RequestOutputKind": "pdserve.sampling_params",
    "PoolingParams": "pdserve.pooling_params",
    "StructuredOutputsParams": "pdserve.structured_outputs",
    "BeamSearchParams": "pdserve.beam_search",
    "RequestOutput": "pdserve.outputs",
    "CompletionOutput": "pdserve.outputs",
    "Logprob": "pdserve.outputs",
    "PoolingOutput": "pdserve.outputs",
    "PoolingRequestOutput": "pdserve.outputs",
    "EmbeddingOutput": "pdserve.outputs",
    "EmbeddingRequestOutput": "pdserve.outputs",
    "TextPrompt": "pdserve.inputs",
    "TokensPrompt": "pdserve.inputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "__version__":  # the package metadata's (pdserve.version)
        from pdserve.version import version

        return version()
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
