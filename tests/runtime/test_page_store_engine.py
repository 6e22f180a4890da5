"""The page store under the pool, end to end (issue #33): greedy ids identical to recomputation
whether a prefix comes from the pool, host memory or disk; restarts; shared directories; faults."""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.llm import LLM
from tinyserve_trt.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPT_TOKENS = 41  # 10 full pages of 4 + one token


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, PROMPT_TOKENS).tolist() for _ in range(n)]


def small_llm(pkg, manifest, pages: int = 16, **kw) -> LLM:
    """An engine whose pool holds ``pages`` pages: one prompt and a bit, so the next evicts it."""
    one = CacheConfig.page_bytes(manifest["page_size"], manifest["num_layers"], manifest["num_kv_heads"],
                                 manifest["head_dim"], manifest["dtype"])
    return LLM(pkg, memory=pages * one, max_batch=2, dense=True, **kw)


@pytest.fixture(scope="module")
def reference(llama):
    """Greedy ids of every prompt, computed in full (no prefix reuse at all)."""
    _, pkg, _ = llama
    llm = LLM(pkg, prefix_sharing=False, max_batch=2, dense=True)
    ps = prompts(4)
    out = {tuple(p): o.outputs[0].token_ids for p, o in zip(ps, llm.generate(prompt_token_ids=ps, params=GREEDY))}
    llm.close()
    return out


def run(llm: LLM, ps) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, params=GREEDY)]
    llm.engine.scheduler.check_integrity()
    llm.engine.pool.check_integrity(check_data=True)
    return out


def expected(reference, ps):
    return [reference[tuple(p)] for p in ps]


def test_evicted_prefix_returns_from_host_memory(llama, reference):
    _, pkg, manifest = llama
    ps = prompts(4)
    llm = small_llm(pkg, manifest, kv_cache_host_gb=0.01)
    # one at a time: each prompt evicts the previous one's pages from the 16-page pool
    assert [run(llm, [p])[0] for p in ps + ps] == expected(reference, ps + ps)
    s = llm.stats()
    assert s["prefix_pages_host"] >= 4 * 10 and s["kv_store_host_hits"] == s["prefix_pages_host"]
    assert s["kv_store_host_puts"] > 0 and set(s["ttft_by_prefix_source"]) >= {"none", "host"}
    llm.close()


def test_a_restart_serves_the_prefix_from_disk(llama, reference, tmp_path):
    _, pkg, manifest = llama
    ps = prompts(2)
    first = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    assert run(first, ps) == expected(reference, ps)
    first.close()  # the pages still cached in the pool are written at close
    again = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    assert run(again, ps[::-1]) == expected(reference, ps[::-1])
    s = again.stats()
    assert s["prefix_pages_disk"] == 2 * 10 and s["kv_store_disk_dropped"] == 0
    assert s["ttft_by_prefix_source"]["disk"]["requests"] == 2
    assert s["prefill_tokens"] == 0  # only each prompt's last token was computed (a one-token row)
    again.close()


def _entries(root):
    return sorted(p for p in root.rglob("*.kvp"))


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_damaged_entries_are_dropped_and_the_request_still_completes(llama, reference, tmp_path, caplog, how):
    _, pkg, manifest = llama
    ps = prompts(1)
    first = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    run(first, ps)
    first.close()
    files = _entries(tmp_path)
    assert len(files) == 11  # 41 prompt + 5 generated tokens: 11 full pages
    for path in files[::3]:
        raw = path.read_bytes()
        path.write_bytes(raw[:-7] if how == "truncated" else raw[:-9] + bytes([raw[-9] ^ 1]) + raw[-8:])
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        again = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
        assert run(again, ps) == expected(reference, ps)
    s = again.stats()
    assert s["kv_store_disk_dropped"] >= 1 and any("dropped" in r.message for r in caplog.records)
    assert s["prefix_pages_disk"] < 10  # served only up to the first bad page
    again.close()


def test_a_store_of_another_package_identity_is_never_served(llama, reference, tmp_path, monkeypatch):
    _, pkg, manifest = llama
    from tinyserve_trt.runtime.kvstore import identity

    ps = prompts(1)
    real = identity.StoreIdentity.of_package.__func__
    monkeypatch.setattr(identity.StoreIdentity, "of_package", classmethod(
        lambda cls, *a, **k: __import__("dataclasses").replace(real(cls, *a, **k), package="another-model")))
    other = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    run(other, ps)
    other.close()
    monkeypatch.undo()
    ours = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    assert run(ours, ps) == expected(reference, ps)
    assert ours.stats()["prefix_pages_disk"] == 0 and ours.stats()["kv_store_disk_entries"] == 0
    ours.close()


def test_a_full_disk_skips_pages_and_changes_nothing_else(llama, reference, tmp_path, monkeypatch, caplog):
    _, pkg, manifest = llama
    from tinyserve_trt.runtime.kvstore import disk

    ps = prompts(3)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", full)
    llm = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        assert [run(llm, [p])[0] for p in ps + ps] == expected(reference, ps + ps)
        llm.engine.store.wait()  # the writer thread tried them all
    s = llm.stats()
    # (a page still in the writer's queue may be served from it - counted as the disk tier - so this engine's
    # prefix_pages_disk depends on how far the writer lagged; what reached the disk is what matters)
    assert s["kv_store_disk_skipped"] > 0 and s["kv_store_disk_entries"] == 0
    assert any("disk full" in r.message for r in caplog.records)
    assert not list(tmp_path.rglob("*.tmp"))
    llm.close()
    again = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))  # nothing was written, so nothing comes back
    assert run(again, ps) == expected(reference, ps) and again.stats()["prefix_pages_disk"] == 0
    again.close()


def test_a_replica_started_first_reads_what_another_writes_later(llama, reference, tmp_path):
    _, pkg, manifest = llama
    ps = prompts(2)
    second = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path))  # started before anything was written
    writer = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path), kv_cache_write_through=True)
    assert run(writer, ps) == expected(reference, ps)
    writer.engine.store.wait()  # published (a replica's writer thread lags its step by a few ms)
    assert run(second, ps) == expected(reference, ps)
    assert second.stats()["prefix_pages_disk"] == 2 * 10
    writer.close()
    second.close()


def test_a_replica_started_second_answers_a_warm_prefix_from_the_shared_store(llama, reference, tmp_path):
    """Two replicas on one --kv-cache-dir, the second started after the first served a prompt (and
    still running): the second's first request with that prompt reads its prefix from disk - no
    prefill - and decodes the ids a recomputation gives."""
    _, pkg, manifest = llama
    ps = prompts(1)
    first = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path), kv_cache_write_through=True)
    assert run(first, ps) == expected(reference, ps)
    first.engine.store.wait()  # published (another process: its writer thread lags a few ms)
    second = small_llm(pkg, manifest, kv_cache_dir=str(tmp_path), kv_cache_write_through=True)
    seq = second.engine.add_request("warm", ps[0], GREEDY)
    while second.engine.has_unfinished():
        second.engine.step()
    assert seq.output_token_ids == expected(reference, ps)[0]
    assert seq.stats.prefix_source == "disk" and seq.stats.prefix_pages_by_tier == {"disk": 10}
    s = second.stats()
    assert s["prefix_pages_disk"] == 10 and s["prefill_tokens"] == 0
    assert set(s["ttft_by_prefix_source"]) == {"disk"} and s["ttft_by_prefix_source"]["disk"]["requests"] == 1
    assert first.stats()["ttft_by_prefix_source"].keys() == {"none"}  # the first one computed it
    second.close()
    first.close()


def test_two_engines_racing_on_one_directory_serve_only_sound_pages(llama, reference, tmp_path):
    _, pkg, manifest = llama
    ps = prompts(4)
    llms = [small_llm(pkg, manifest, kv_cache_dir=str(tmp_path), kv_cache_write_through=True) for _ in range(2)]
    results, errors = {}, []

    def work(i):
        try:
            order = ps if i == 0 else ps[::-1]
            results[i] = ([run(llms[i], [p])[0] for p in order + order], order + order)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, order in results.values():
        assert got == expected(reference, order)
    for llm in llms:
        llm.close()
    assert all(llm.stats()["kv_store_disk_dropped"] == 0 for llm in llms)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_store_options_are_validated():
    from tinyserve_trt.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_max_gb"):
        EngineConfig(kv_cache_dir="/tmp/x", kv_cache_max_gb=0)
    with pytest.raises(ValueError, match="kv_cache_host_gb"):
        EngineConfig(kv_cache_host_gb=-1)
    with pytest.raises(ValueError, match="prefix sharing"):
        EngineConfig(kv_cache_dir="/tmp/x", prefix_sharing=False)
    with pytest.raises(ValueError, match="needs a page store"):
        EngineConfig(kv_cache_write_through=True)
    with pytest.raises(ValueError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir=3)
    assert os.fspath(EngineConfig(kv_cache_dir="d").kv_cache_dir) == "d"


def test_a_tiered_pool_stores_its_pages_and_stays_whole(llama_cold, tmp_path):
    _, pkg, manifest = llama_cold
    ps = prompts(3, seed=1)
    llm = LLM(pkg, max_batch=2, memory=24 * CacheConfig.page_bytes(
        manifest["page_size"], manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"],
        manifest["dtype"]), kv_cache_host_gb=0.01, hot_fraction=0.5)
    assert llm.engine.tiering is not None
    assert llm.engine.store.identity.format == "hot-v1+int8-dynamic"  # never read by an all-hot engine
    for p in ps + ps:
        out = run(llm, [p])[0]
        assert len(out) == GREEDY.max_tokens
    s = llm.stats()
    assert s["kv_store_host_puts"] > 0 and s["prefix_pages_host"] > 0
    llm.close()


def test_the_package_identity_is_stable_and_tells_packages_apart(llama, llama_cold):
    from tinyserve_trt.runtime.kvstore import StoreIdentity
    from tinyserve_trt.runtime.model_package import ModelPackage

    a, b = (ModelPackage.load(llama[1]) for _ in range(2))
    assert StoreIdentity.of_package(a) == StoreIdentity.of_package(b)
    cold = StoreIdentity.of_package(ModelPackage.load(llama_cold[1]))
    assert cold.package != StoreIdentity.of_package(a).package and cold.digest != StoreIdentity.of_package(a).digest
    assert StoreIdentity.of_package(a, dtype="float16").digest != StoreIdentity.of_package(a).digest
