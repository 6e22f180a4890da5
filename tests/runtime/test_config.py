import pytest

from tests.runtime.backend_options import backend_options
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve_trt.contracts.budget import DecodeBudget


def test_defaults_are_valid():
    CacheConfig()
    SchedulerConfig()


@pytest.mark.parametrize("kwargs, field", [
    ({"page_size": 0}, "page_size"),
    ({"num_pages": -1}, "num_pages"),
    ({"num_pages": 2.5}, "num_pages"),
    ({"dtype": "int8"}, "dtype"),
    ({"prefix_cache": ""}, "prefix_cache"),
])
def test_cache_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_batch": 0}, "max_batch"),
    ({"max_tokens_per_step": True}, "max_tokens_per_step"),
    ({"prefill_chunk": 4096, "max_tokens_per_step": 1024}, "prefill_chunk"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"token_budget": -1}, "token_budget"),
    ({"eos_token_id": -3}, "eos_token_id"),
    ({"sparse_min_ratio": -0.5}, "sparse_min_ratio"),
    ({"sparse_min_ratio": float("nan")}, "sparse_min_ratio"),
    ({"sparse_min_ratio": float("inf")}, "sparse_min_ratio"),
    ({"sparse_min_ratio": True}, "sparse_min_ratio"),
    ({"sparse_min_ratio": "2"}, "sparse_min_ratio"),
])
def test_scheduler_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_from_memory_bytes():
    one = CacheConfig.page_bytes(16, 2, 4, 8, "float16")
    # K and V tokens + key_min/key_max, two bytes each, two layers
    assert one == 2 * (2 * 4 * 16 * 8 + 2 * 4 * 8) * 2
    cfg = CacheConfig.from_memory(num_layers=2, num_kv_heads=4, head_dim=8,
                                  memory_bytes=10 * one + one // 2)
    assert cfg.num_pages == 10 and cfg.page_size == 16


def test_from_memory_fraction_and_errors():
    cfg = CacheConfig.from_memory(num_layers=1, num_kv_heads=1, head_dim=8, memory_fraction=1e-6)
    assert cfg.num_pages >= 1
    with pytest.raises(ValueError, match="exactly one"):
        CacheConfig.from_memory(num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="memory_fraction"):
        CacheConfig.from_memory(num_layers=1, num_kv_heads=1, head_dim=8, memory_fraction=1.5)
    with pytest.raises(ValueError, match="holds no page"):
        CacheConfig.from_memory(num_layers=1, num_kv_heads=1, head_dim=8, memory_bytes=10)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), None, False, "2"])
def test_engine_config_rejects_sparse_min_ratio_in_one_line(value):
    from tinyserve_trt.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="sparse_min_ratio must be a finite number >= 0") as e:
        EngineConfig(sparse_min_ratio=value)
    assert "\n" not in str(e.value)


def test_engine_config_passes_sparse_min_ratio_to_the_scheduler():
    from tinyserve_trt.runtime.config import SPARSE_MIN_RATIO, EngineConfig

    budget = DecodeBudget(8)
    assert EngineConfig().scheduler_config(budget=budget, eos_token_id=None).sparse_min_ratio == SPARSE_MIN_RATIO
    assert EngineConfig(sparse_min_ratio=0).scheduler_config(budget=budget, eos_token_id=None).sparse_min_ratio == 0


# ---- issue #32: the TINYSERVE_* switches are config fields, passed to the backend that reads them ----
@pytest.mark.parametrize("backend, fields, options", [
    ("ort", dict(native_arch="x86-64-v2", plugin_dir="/opt/tinyserve"),
     dict(native_arch="x86-64-v2", plugin_dir="/opt/tinyserve")),
    ("trt", dict(cuda_graphs=False, plugin_dir="/opt/tinyserve"), dict(cuda_graphs=False, plugin_dir="/opt/tinyserve")),
    ("trt", dict(native_arch="x86-64-v2"), {}),  # the TensorRT backend has no CPU kernel to build
    ("ort", dict(cuda_graphs=False), {}),  # nor ORT decode-step graphs to turn off
])
def test_kernel_fields_reach_the_backend(monkeypatch, backend, fields, options):
    seen = backend_options(monkeypatch, EngineConfig(backend=backend, **fields))
    assert {k: seen[k] for k in ("native_arch", "plugin_dir", "cuda_graphs") if k in seen} == options


@pytest.mark.parametrize("fields, match", [
    (dict(native_arch="native; rm -rf /"), "native_arch"), (dict(native_arch=""), "native_arch"),
    (dict(cuda_graphs="no"), "cuda_graphs"), (dict(require_native=1), "require_native"),
    (dict(plugin_dir=""), "plugin_dir"), (dict(plugin_dir=3), "plugin_dir"),
])
def test_kernel_fields_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)
