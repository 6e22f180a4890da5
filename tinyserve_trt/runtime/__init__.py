"""Serving runtime: sequences, the paged KV pool and prefix cache, the scheduler, sampling,
the engine loop, backends (``backends/``) and the LLM / AsyncLLM APIs.

Everything exported here is pure Python + numpy; backends (ort, trt) import their
heavy dependencies inside their factories.
"""

from tinyserve_trt.runtime.batch import ScheduledBatch
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool, PoolIntegrityError
from tinyserve_trt.runtime.prefix_cache import PREFIX_CACHES, PrefixCache, make_prefix_cache
from tinyserve_trt.runtime.sampling import SampleOutput, Sampler, SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason, Sequence, SequenceStatus
from tinyserve_trt.runtime.model_package import ModelPackage, PackageError
from tinyserve_trt.runtime.engine import Engine
from tinyserve_trt.runtime.outputs import CompletionOutput, RequestOutput, RequestStats
from tinyserve_trt.runtime.llm import LLM
from tinyserve_trt.runtime.async_llm import AsyncLLM

__all__ = [
    "AsyncLLM", "CompletionOutput", "Engine", "EngineConfig", "LLM", "ModelPackage", "PackageError",
    "RequestOutput", "RequestStats",
    "CacheConfig", "FinishReason", "OutOfPagesError", "PREFIX_CACHES", "PagePool", "PoolIntegrityError",
    "PrefixCache", "SampleOutput", "Sampler", "SamplingParams", "ScheduledBatch", "Scheduler",
    "SchedulerConfig", "Sequence", "SequenceStatus", "make_prefix_cache",
]
