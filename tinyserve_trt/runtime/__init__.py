"""Serving runtime: sequences, the paged KV pool and prefix cache, the scheduler, sampling.

Everything exported here is pure Python + numpy; backends (ort, trt) import their
heavy dependencies inside their factories.
"""

from tinyserve_trt.runtime.batch import ScheduledBatch
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool, PoolIntegrityError
from tinyserve_trt.runtime.prefix_cache import PREFIX_CACHES, PrefixCache, make_prefix_cache
from tinyserve_trt.runtime.sampling import SampleOutput, Sampler, SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "CacheConfig", "FinishReason", "OutOfPagesError", "PREFIX_CACHES", "PagePool", "PoolIntegrityError",
    "PrefixCache", "SampleOutput", "Sampler", "SamplingParams", "ScheduledBatch", "Scheduler",
    "SchedulerConfig", "Sequence", "SequenceStatus", "make_prefix_cache",
]
