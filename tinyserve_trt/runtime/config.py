"""Runtime configuration: the KV page cache and the scheduler.

Frozen dataclasses validated in ``__post_init__`` (ValueError with the field
name); the CLI takes its defaults from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.cpu.native import is_march_name
from tinyserve_trt.runtime.limits import INT32_MAX

KV_DTYPES = ("float32", "float16")
# a decode row selects pages only once its context reaches this many times its token budget;
# below, it decodes dense (exact, and cheaper: the selection would keep most pages anyway).
# Chosen by measurement (benchmarks/results/sparse_threshold.md); lower it when selection gets cheaper
SPARSE_MIN_RATIO = 4.0
ORT_PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")  # backends.ort_providers.PROVIDERS reads this


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_sparse_min_ratio(value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < float("inf"):
        raise ValueError(f"sparse_min_ratio must be a finite number >= 0, got {value!r}")


def total_ram_bytes() -> int:
    """Physical memory of this machine in bytes (POSIX sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    page_size:    tokens per page (``ps`` in the op schema).
    num_pages:    hot pages in the pool (``P``); page ids are ``[0, num_pages)``.
    dtype:        K/V pool and key_min/key_max dtype, ``float32`` or ``float16``.
    prefix_cache: name in the prefix-cache registry (``hash`` or ``none``).
    sub_page_size: two-level selection's sub-page tokens (the package's): the pool keeps
                  ``key_sub_bounds`` per page; 0 (single level) keeps none.

    Use :meth:`from_memory` to size ``num_pages`` from a byte budget.
    """

    page_size: int = 16
    num_pages: int = 1024
    dtype: str = "float16"
    prefix_cache: str = "hash"
    sub_page_size: int = 0

    def __post_init__(self):
        _positive_int("page_size", self.page_size)
        if not isinstance(self.sub_page_size, int) or self.sub_page_size < 0 or (
                self.sub_page_size and (self.page_size % self.sub_page_size or self.sub_page_size == self.page_size)):
            raise ValueError(f"sub_page_size must be 0 or a proper divisor of page_size {self.page_size}, "
                             f"got {self.sub_page_size!r}")
        _positive_int("num_pages", self.num_pages)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.prefix_cache, str) or not self.prefix_cache:
            raise ValueError(f"prefix_cache must be a registry name, got {self.prefix_cache!r}")

    @staticmethod
    def page_bytes(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: str = "float16") -> int:
        """Bytes one page costs over all layers: K and V tokens plus key_min/key_max."""
        for name, value in (("page_size", page_size), ("num_layers", num_layers),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            _positive_int(name, value)
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {dtype!r}")
        item = np.dtype(dtype).itemsize
        per_layer = 2 * num_kv_heads * page_size * head_dim + 2 * num_kv_heads * head_dim
        return num_layers * per_layer * item

    @classmethod
    def from_memory(cls, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    memory_bytes: int | None = None, memory_fraction: float | None = None,
                    page_size: int = 16, dtype: str = "float16",
                    prefix_cache: str = "hash") -> CacheConfig:
        """A config whose pool fits ``memory_bytes`` or ``memory_fraction`` of physical RAM.

        Exactly one of ``memory_bytes`` / ``memory_fraction`` must be given.
        Raises ValueError when the budget holds no page at all.
        """
        if (memory_bytes is None) == (memory_fraction is None):
            raise ValueError("give exactly one of memory_bytes or memory_fraction")
        if memory_fraction is not None:
            if not isinstance(memory_fraction, (int, float)) or not 0.0 < memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
            memory_bytes = int(total_ram_bytes() * memory_fraction)
        _positive_int("memory_bytes", memory_bytes)
        one = cls.page_bytes(page_size, num_layers, num_kv_heads, head_dim, dtype)
        num_pages = memory_bytes // one
        if num_pages < 1:
            raise ValueError(f"memory budget of {memory_bytes} bytes holds no page "
                             f"(one page costs {one} bytes over {num_layers} layers)")
        return cls(page_size=page_size, num_pages=num_pages, dtype=dtype, prefix_cache=prefix_cache)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_batch:           sequences per step.
    max_tokens_per_step: new tokens per step over the whole batch (prefill + decode).
    prefill_chunk:       most prompt tokens one sequence computes in one step.
    max_seq_len:         prompt + generated tokens allowed per sequence (None: the pool's capacity).
    token_budget:        default Quest decode budget in tokens (0 = dense); a request's
                         ``SamplingParams.token_budget`` overrides it (a fixed budget).
    budget_share:        the default budget's share of a row's context above ``token_budget``
                         (``contracts.budget.DecodeBudget``); 0 = fixed.
    sparse_min_ratio:    a decode row whose context (cached + new tokens) is below this many
                         times its budget decodes dense (budget 0); 0 (here the default: the
                         scheduler alone does what the budgets say) = select at any context.
                         ``EngineConfig`` passes its own, whose default is ``SPARSE_MIN_RATIO``.
    eos_token_id:        finishes a sequence unless its params set ``ignore_eos``; None = no EOS.
    """

    max_batch: int = 64
    max_tokens_per_step: int = 2048
    prefill_chunk: int = 512
    max_seq_len: int | None = None
    token_budget: int = 0
    eos_token_id: int | None = None
    sparse_min_ratio: float = 0.0
    budget_share: float = 0.0

    def __post_init__(self):
        _positive_int("max_batch", self.max_batch)
        _positive_int("max_tokens_per_step", self.max_tokens_per_step)
        _positive_int("prefill_chunk", self.prefill_chunk)
        if self.prefill_chunk > self.max_tokens_per_step:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must not exceed "
                             f"max_tokens_per_step ({self.max_tokens_per_step})")
        if self.max_seq_len is not None:
            _positive_int("max_seq_len", self.max_seq_len)
        DecodeBudget(self.token_budget, self.budget_share)  # ValueError, one line
        if self.eos_token_id is not None and (not isinstance(self.eos_token_id, int)
                                              or self.eos_token_id < 0):
            raise ValueError(f"eos_token_id must be a token id >= 0 or None, got {self.eos_token_id!r}")
        check_sparse_min_ratio(self.sparse_min_ratio)


@dataclass(frozen=True)
class EngineConfig:
    """What ``LLM`` / ``AsyncLLM`` / ``tinyserve generate`` take; resolved against a package.

    backend:             backend registry name (``ort``; ``trt`` with issue #5).
    token_budget:        default Quest decode budget in tokens; None = the package's default.
    budget_share:        the default budget's share of the context above ``token_budget``; None = the
                         package's when ``token_budget`` is None too, else 0 (a budget given is fixed).
    dense:               attend every page at decode (budget 0); overrides token_budget.
    sparse_min_ratio:    a sequence decodes dense while its context is below this many times its
                         token budget (the engine's or its request's), sparse from there on: at
                         short contexts the selection keeps most pages and costs more than it
                         saves, and dense is exact. 0 = sparse whenever the budget is below the
                         context. Default ``SPARSE_MIN_RATIO``, measured in
                         benchmarks/results/sparse_threshold.md.
    memory:              KV pool size: bytes (int > 1) or a fraction of RAM (float in (0, 1]);
                         None = room for ``max_batch`` sequences of the package's max context,
                         capped at half the RAM.
    prefix_sharing:      reuse full KV pages of identical prompt prefixes.
    max_batch, max_tokens_per_step, prefill_chunk, max_seq_len: see SchedulerConfig.
    threads:             backend intra-op threads (None: the backend's default).
    kv_tiers:            keep rarely selected pages as INT8 when the package has a cold tier
                         (``tinyserve-export --calibration``); False: every page hot.
    hot_fraction:        share of live pages kept hot, in [0, 1]; None = the package's calibrated
                         value; 1.0 never demotes.
    hot_pages:           most pages kept hot (with or instead of hot_fraction); None = no cap.
    hot_decay:           per-step decay of the page hit counts, in (0, 1]; None = the package's.
    kv_scales:           INT8 scales of cold pages: ``dynamic`` (each page's absmax) or ``static``
                         (the package's calibration ranges; values outside them clip).
    ort_provider:        ONNX Runtime EP of the ``ort`` backend: ``auto``, ``cpu``, ``cuda`` (pages on
                         the GPU) or ``tensorrt`` (our plugin through ORT's TensorRT EP); docs/gpu_paths.md.
    kv_cache_dir:        a directory for a disk page store below the pool (issue #33): prefix pages the
                         pool evicts (and, at close, the cached ones) are kept there and reused by later
                         requests, restarts and other replicas pointing at the same directory; None = none.
    kv_cache_max_gb:     most GiB the disk store holds (it evicts the least reused entries past it).
    kv_cache_host_gb:    GiB of host memory for evicted pages before they go to disk (0 = none; alone,
                         without ``kv_cache_dir``: a memory-only store).
    kv_cache_write_through: store every prefix page as soon as it is computed, not only when evicted
                         (replicas sharing ``kv_cache_dir`` see each other's prompts at once).
    trust_package_engines: let the TensorRT EP load engines the package ships in ``trt_ep_cache``
                         (engines are code); False: its engine cache is this user's
                         (``~/.cache/tinyserve/trt_ep_cache``), built here.
    require_native:      refuse to start unless the op decodes on a native kernel (the C++ CPU node or
                         the TensorRT plugin): a fallback to the op's ONNX function (no compiler, a
                         library that does not load, a package exported without it) is an error
                         (``backends.kernel_report.NativeRequired``) instead of a slower engine.
    native_arch:         ``-march`` target of the native CPU kernel's build (e.g. ``x86-64-v2`` for a build
                         cache shared by several CPUs); None: ``$TINYSERVE_NATIVE_ARCH`` if set, else ``native``.
    plugin_dir:          where ``tinyserve-build-plugin -o DIR`` put the GPU libraries (``libqsa_kernels.so``,
                         ``libtinyserve_trt_plugin.so``); None: its default cache (``~/.cache/tinyserve/plugins``),
                         ``$TINYSERVE_QSA_LIB`` / ``$TINYSERVE_TRT_PLUGIN`` when set, a checkout's build/plugins/.
    cuda_graphs:         the TensorRT backend replays decode steps as CUDA graphs; False: plain launches.
    """

    backend: str = "ort"
    token_budget: int | None = None
    budget_share: float | None = None
    dense: bool = False
    sparse_min_ratio: float = SPARSE_MIN_RATIO
    memory: int | float | None = None
    prefix_sharing: bool = True
    max_batch: int = 64
    max_tokens_per_step: int = 2048
    prefill_chunk: int = 512
    max_seq_len: int | None = None
    threads: int | None = None
    kv_tiers: bool = True
    hot_fraction: float | None = None
    hot_pages: int | None = None
    hot_decay: float | None = None
    kv_scales: str = "dynamic"
    ort_provider: str = "auto"
    trust_package_engines: bool = False
    require_native: bool = False
    native_arch: str | None = None
    plugin_dir: str | None = None
    cuda_graphs: bool = True
    kv_cache_dir: str | None = None
    kv_cache_max_gb: float = 16.0
    kv_cache_host_gb: float = 0.0
    kv_cache_write_through: bool = False

    def __post_init__(self):
        for name in ("require_native", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.native_arch is not None and (not isinstance(self.native_arch, str)
                                             or not is_march_name(self.native_arch)):
            raise ValueError(f"native_arch must be a -march target name (e.g. x86-64-v2) or None, "
                             f"got {self.native_arch!r}")
        if self.plugin_dir is not None and (not isinstance(self.plugin_dir, (str, os.PathLike))
                                            or not str(self.plugin_dir)):
            raise ValueError(f"plugin_dir must be a directory path or None, got {self.plugin_dir!r}")
        if self.kv_cache_dir is not None and (not isinstance(self.kv_cache_dir, (str, os.PathLike))
                                              or not str(self.kv_cache_dir)):
            raise ValueError(f"kv_cache_dir must be a directory path or None, got {self.kv_cache_dir!r}")
        for name in ("kv_cache_max_gb", "kv_cache_host_gb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf") \
                    or (name == "kv_cache_max_gb" and value == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if name == 'kv_cache_max_gb' else '>= 0'}, "
                                 f"got {value!r}")
        if not isinstance(self.kv_cache_write_through, bool):
            raise ValueError(f"kv_cache_write_through must be a bool, got {self.kv_cache_write_through!r}")
        if not self.prefix_sharing and (self.kv_cache_dir is not None or self.kv_cache_host_gb):
            raise ValueError("a KV page store (kv_cache_dir / kv_cache_host_gb) needs prefix sharing on")
        if self.kv_cache_write_through and self.kv_cache_dir is None and not self.kv_cache_host_gb:
            raise ValueError("kv_cache_write_through needs a page store (kv_cache_dir or kv_cache_host_gb)")
        if not isinstance(self.trust_package_engines, bool):
            raise ValueError(f"trust_package_engines must be a bool, got {self.trust_package_engines!r}")
        if self.ort_provider not in ORT_PROVIDERS:
            raise ValueError(f"ort_provider must be one of {ORT_PROVIDERS}, got {self.ort_provider!r}")
        check_sparse_min_ratio(self.sparse_min_ratio)
        if self.kv_scales not in ("dynamic", "static"):
            raise ValueError(f"kv_scales must be 'dynamic' or 'static', got {self.kv_scales!r}")
        if self.hot_fraction is not None and (not isinstance(self.hot_fraction, (int, float))
                                              or isinstance(self.hot_fraction, bool)
                                              or not 0.0 <= self.hot_fraction <= 1.0):
            raise ValueError(f"hot_fraction must be in [0, 1] or None, got {self.hot_fraction!r}")
        if self.hot_pages is not None and (not isinstance(self.hot_pages, int) or isinstance(self.hot_pages, bool)
                                           or self.hot_pages < 0):
            raise ValueError(f"hot_pages must be an int >= 0 or None, got {self.hot_pages!r}")
        if self.hot_decay is not None and (not isinstance(self.hot_decay, (int, float))
                                           or not 0.0 < self.hot_decay <= 1.0):
            raise ValueError(f"hot_decay must be in (0, 1] or None, got {self.hot_decay!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a registry name, got {self.backend!r}")
        if self.token_budget is not None and (not isinstance(self.token_budget, int)
                                              or isinstance(self.token_budget, bool) or self.token_budget < 0):
            raise ValueError(f"token_budget must be an int >= 0 or None, got {self.token_budget!r}")
        if self.budget_share is not None:
            DecodeBudget(0, self.budget_share)  # ValueError, one line
        if self.memory is not None:
            ok_fraction = isinstance(self.memory, float) and 0.0 < self.memory <= 1.0
            ok_bytes = isinstance(self.memory, int) and not isinstance(self.memory, bool) and self.memory > 1
            if not (ok_fraction or ok_bytes):
                raise ValueError(f"memory must be bytes (int > 1) or a RAM fraction in (0, 1], got {self.memory!r}")
        if self.threads is not None:
            _positive_int("threads", self.threads)
        for name in ("token_budget", "max_batch", "max_tokens_per_step", "prefill_chunk", "max_seq_len", "threads",
                     "hot_pages"):  # they reach the model and the pools as int32
            value = getattr(self, name)
            if value is not None and value > INT32_MAX:
                raise ValueError(f"{name} must be <= {INT32_MAX}, got {value!r}")
        # the scheduler's own checks, with its field names
        SchedulerConfig(max_batch=self.max_batch, max_tokens_per_step=self.max_tokens_per_step,
                        prefill_chunk=self.prefill_chunk, max_seq_len=self.max_seq_len)

    def resolved_budget(self, package_default: int) -> int:
        return 0 if self.dense else package_default if self.token_budget is None else self.token_budget

    def resolved_budget_share(self, package_default: float) -> float:
        if self.budget_share is not None:
            return self.budget_share
        return package_default if self.token_budget is None else 0.0

    def decode_budget(self, package) -> DecodeBudget:
        """The engine's default decode budget against ``package`` (its manifest's default)."""
        return DecodeBudget(self.resolved_budget(package.token_budget),
                            self.resolved_budget_share(package.budget_share))

    def cache_config(self, *, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: str, max_context: int) -> CacheConfig:
        prefix = "hash" if self.prefix_sharing else "none"
        kw = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                  dtype=dtype, prefix_cache=prefix)
        if self.memory is None:
            by_ram = CacheConfig.from_memory(memory_fraction=0.5, **kw)
            wanted = self.max_batch * -(-(self.max_seq_len or max_context) // page_size)
            return CacheConfig(page_size=page_size, num_pages=min(wanted, by_ram.num_pages), dtype=dtype,
                               prefix_cache=prefix)
        if isinstance(self.memory, float):
            return CacheConfig.from_memory(memory_fraction=self.memory, **kw)
        return CacheConfig.from_memory(memory_bytes=self.memory, **kw)

    def scheduler_config(self, *, budget: DecodeBudget, eos_token_id: int | None) -> SchedulerConfig:
        return SchedulerConfig(max_batch=self.max_batch, max_tokens_per_step=self.max_tokens_per_step,
                               prefill_chunk=self.prefill_chunk, max_seq_len=self.max_seq_len,
                               token_budget=budget.tokens, budget_share=budget.share, eos_token_id=eos_token_id,
                               sparse_min_ratio=self.sparse_min_ratio)
