"""The page store (issue #33): entries, tiers, reuse eviction and the disk store's faults."""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np
import pytest

from tinyserve_trt.runtime.kvstore import (
    PAGE_STORES,
    PageBlock,
    StoreIdentity,
    make_page_store,
)
from tinyserve_trt.runtime.kvstore.block import (
    HEADER_SIZE,
    BadEntry,
    decode,
    encode,
    entry_size,
)
from tinyserve_trt.runtime.kvstore.disk import DiskPageStore
from tinyserve_trt.runtime.kvstore.host import HostPageStore
from tinyserve_trt.runtime.kvstore.reuse import ReuseIndex

IDENT = StoreIdentity(package="a" * 32, num_layers=2, num_kv_heads=1, page_size=4, head_dim=2, dtype="float32")
SUB = StoreIdentity(package="a" * 32, num_layers=2, num_kv_heads=1, page_size=4, head_dim=2, dtype="float32",
                    sub_page_size=2)


def block(seed: int, ident: StoreIdentity = IDENT) -> PageBlock:
    rng = np.random.default_rng(seed)
    L, h, ps, d = ident.num_layers, ident.num_kv_heads, ident.page_size, ident.head_dim
    k = rng.standard_normal((L, h, ps, d)).astype(ident.dtype)
    sub = rng.integers(0, 255, (L, h, ps // ident.sub_page_size, d)).astype(np.uint8) if ident.sub_page_size else None
    return PageBlock(tokens=rng.integers(0, 100, ps).astype(np.int64), parent=bytes([seed % 256]) * 16 if seed else None,
                     num_valid=np.full(L, ps, np.int32), k=k, v=rng.standard_normal(k.shape).astype(ident.dtype),
                     key_min=k.min(axis=2), key_max=k.max(axis=2), sub=sub)


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def same(a: PageBlock, b: PageBlock) -> bool:
    return a.parent == b.parent and all(
        (x is None and y is None) or np.array_equal(x, y)
        for x, y in ((a.tokens, b.tokens), (a.num_valid, b.num_valid), (a.k, b.k), (a.v, b.v),
                     (a.key_min, b.key_min), (a.key_max, b.key_max), (a.sub, b.sub)))


# ---- entries ------------------------------------------------------------------
@pytest.mark.parametrize("ident", [IDENT, SUB], ids=["single", "two-level"])
def test_entry_round_trip_and_size(ident):
    b = block(3, ident)
    raw = encode(b, H(1), ident)
    assert len(raw) == entry_size(ident) == b.nbytes
    assert same(decode(raw, H(1), ident), b)
    first = block(0, ident)
    assert decode(encode(first, H(2), ident), H(2), ident).parent is None


def test_identity_is_validated_and_every_field_changes_the_digest():
    with pytest.raises(ValueError, match="dtype"):
        StoreIdentity(package="x", num_layers=1, num_kv_heads=1, page_size=4, head_dim=2, dtype="int8")
    with pytest.raises(ValueError, match="page_size"):
        StoreIdentity(package="x", num_layers=1, num_kv_heads=1, page_size=0, head_dim=2, dtype="float32")
    from dataclasses import replace
    others = [replace(IDENT, package="b" * 32), replace(IDENT, page_size=8), replace(IDENT, dtype="float16"),
              replace(IDENT, sub_page_size=2), replace(IDENT, format="int8-v1"), replace(IDENT, num_layers=3)]
    assert len({IDENT.digest, *(o.digest for o in others)}) == len(others) + 1


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw[:-1], "truncated"),
    (lambda raw: raw[:HEADER_SIZE - 3], "truncated header"),
    (lambda raw: raw[:100] + bytes([raw[100] ^ 1]) + raw[101:], "checksum"),
    (lambda raw: b"XXXX" + raw[4:], "magic"),
    (lambda raw: raw[:4] + (9).to_bytes(2, "little") + raw[6:], "version"),
])
def test_a_damaged_entry_is_refused_with_its_reason(damage, match):
    raw = encode(block(1), H(1), IDENT)
    with pytest.raises(BadEntry, match=match):
        decode(damage(raw), H(1), IDENT)


def test_an_entry_of_another_identity_or_hash_is_refused():
    from dataclasses import replace
    raw = encode(block(1), H(1), IDENT)
    with pytest.raises(BadEntry, match="identity"):
        decode(raw, H(1), replace(IDENT, package="b" * 32))
    with pytest.raises(BadEntry, match="hash"):
        decode(raw, H(2), IDENT)
    with pytest.raises(ValueError, match="page block k"):
        encode(block(1, SUB), H(1), replace(IDENT, head_dim=4))


# ---- reuse ----------------------------------------------------------------------
def test_eviction_follows_decayed_hits_not_recency():
    now = [0.0]
    idx = ReuseIndex(half_life_s=10.0, clock=lambda: now[0])
    idx.add(H(1), 10)
    for _ in range(5):
        idx.hit(H(1))  # a page many requests reuse
    now[0] = 5.0
    idx.add(H(2), 10)  # newer, used once
    assert idx.victims(10, 20) == [H(2)]  # plain LRU would evict H(1)
    now[0] = 100.0
    idx.hit(H(2))  # H(2) keeps being used, H(1) no longer: its hits decay away
    now[0] = 110.0
    assert idx.victims(10, 20) == [H(1)]
    assert idx.victims(5, 25) == [] and idx.nbytes == 20


# ---- host tier --------------------------------------------------------------------
def test_registry_and_bad_options(tmp_path):
    assert set(PAGE_STORES) >= {"host", "disk", "host+disk"}
    with pytest.raises(ValueError, match="unknown page store"):
        make_page_store("redis", IDENT)
    with pytest.raises(ValueError, match="directory"):
        make_page_store("disk", IDENT, disk_bytes=1000)
    with pytest.raises(ValueError, match="max_bytes"):
        HostPageStore(IDENT, -1)


def test_host_store_keeps_its_budget_and_demotes_to_disk(tmp_path):
    size = entry_size(IDENT)
    store = make_page_store("host+disk", IDENT, host_bytes=2 * size, directory=tmp_path, disk_bytes=100 * size)
    blocks = {i: block(i) for i in range(1, 6)}
    for i, b in blocks.items():
        assert store.put(H(i), b)
    assert store.num_entries == 2 and store.nbytes <= 2 * size
    assert store.lower.num_entries == 3
    got = store.get_many([H(i) for i in range(1, 6)])
    assert [t for _, t in got].count("host") == 2 and [t for _, t in got].count("disk") == 3
    # the run comes back in order whichever tier holds each page
    host_first = [h for h in (H(i) for i in range(1, 6)) if h in store._blocks]
    assert all(same(b, blocks[int.from_bytes(h, "little")]) for (b, _), h in
               zip(store.get_many(host_first), host_first))
    assert store.get_many([H(99)]) == []
    s = store.stats()
    assert s["host_puts"] == 5 and s["disk_puts"] == 3 and s["host_demoted"] == 3


def test_host_only_store_drops_past_its_budget():
    size = entry_size(IDENT)
    store = HostPageStore(IDENT, size)
    assert store.put(H(1), block(1)) and store.put(H(2), block(2))
    assert not store.contains(H(1)) and store.contains(H(2)) and store.counters["skipped"] == 1


# ---- disk tier --------------------------------------------------------------------
def disk(tmp_path, ident=IDENT, entries=100):
    return DiskPageStore(ident, tmp_path, entries * entry_size(ident))


def test_disk_round_trip_restart_and_read_through(tmp_path):
    a = disk(tmp_path)
    assert a.put(H(1), block(1)) and not a.put(H(1), block(1))  # once
    b = disk(tmp_path)  # a restart: the index is loaded from the directory
    assert b.num_entries == 1 and same(b.get_many([H(1)])[0][0], block(1))
    a.put(H(2), block(2))  # another process publishes after b started
    assert [t for _, t in b.get_many([H(1), H(2)])] == ["disk", "disk"]
    files = sorted(p.name for p in a.root.rglob("*"))
    assert not any(n.endswith(".tmp") for n in files)


def test_disk_bound_evicts_by_reuse(tmp_path):
    store = disk(tmp_path, entries=3)
    for i in (1, 2, 3):
        store.put(H(i), block(i))
    for _ in range(3):
        store.get_many([H(1)])
    store.put(H(4), block(4))  # evicts down to 90% of the bound: the two least reused go
    assert store.num_entries == 2 and store.contains(H(1)) and store.contains(H(4))
    assert store.nbytes <= store.max_bytes and not (store.path(H(2)).exists() or store.path(H(3)).exists())


def _damage(path, how):
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif how == "flipped":
        path.write_bytes(raw[:-5] + bytes([raw[-5] ^ 0x40]) + raw[-4:])


@pytest.mark.parametrize("how", ["truncated", "flipped"])
@pytest.mark.parametrize("when", ["at start", "after start"])
def test_a_damaged_entry_is_dropped_with_one_warning_and_never_served(tmp_path, caplog, how, when):
    a = disk(tmp_path)
    a.put(H(1), block(1))
    a.put(H(2), block(2))
    if when == "after start":
        reader = disk(tmp_path)
    _damage(a.path(H(2)), how)
    if when == "at start":
        reader = disk(tmp_path)
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        got = reader.get_many([H(1), H(2)])
        again = reader.get_many([H(1), H(2)])
    assert len(got) == 1 and same(got[0][0], block(1)) and len(again) == 1
    assert len([r for r in caplog.records if "dropped" in r.message]) == 1
    assert not reader.path(H(2)).exists() and reader.counters["dropped"] == 1


def test_a_store_of_another_package_serves_nothing(tmp_path, caplog):
    from dataclasses import replace
    other = replace(IDENT, package="b" * 32)
    a = disk(tmp_path, other)
    a.put(H(1), block(1))
    ours = disk(tmp_path)
    assert not ours.contains(H(1)) and ours.get_many([H(1)]) == []
    # a foreign entry copied into our directory is dropped by its header, never served
    dst = ours.path(H(1))
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(a.path(H(1)).read_bytes())
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        assert ours.get_many([H(1)]) == []
    assert any("identity" in r.message for r in caplog.records)


def test_a_full_disk_skips_the_entry_with_a_warning(tmp_path, monkeypatch, caplog):
    store = disk(tmp_path)
    store.put(H(1), block(1))
    real = os.fdopen

    def full(fd, *a, **k):
        f = real(fd, *a, **k)

        class Full:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")
        return Full()

    monkeypatch.setattr(os, "fdopen", full)
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        assert not store.put(H(2), block(2))
    monkeypatch.undo()
    assert any("disk full" in r.message for r in caplog.records)
    assert store.num_entries == 1 and store.counters["skipped"] == 1
    assert not list(store.root.rglob("*.tmp")) and not store.path(H(2)).exists()
    assert same(store.get_many([H(1)])[0][0], block(1))
    assert store.put(H(2), block(2))  # room again: written


def test_one_writer_per_entry(tmp_path):
    a, b = disk(tmp_path), disk(tmp_path)
    tmp = a.path(H(1)).with_name(a.path(H(1)).name + ".tmp")
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"half-written")  # another writer is at it
    assert not b.put(H(1), block(1)) and not b.path(H(1)).exists()
    os.utime(tmp, (0, 0))  # ... or crashed long ago: its temp file is replaced
    assert b.put(H(1), block(1)) and same(a.get_many([H(1)])[0][0], block(1))


def test_readers_racing_writers_never_see_a_partial_entry(tmp_path):
    writers = [disk(tmp_path) for _ in range(2)]
    reader = disk(tmp_path)
    n, bad, done = 40, [], threading.Event()

    def write(store):
        for i in range(1, n + 1):
            store.put(H(i), block(i))

    def read():
        while not done.is_set():
            for i in range(1, n + 1):
                for b, _ in reader.get_many([H(i)]):
                    if not same(b, block(i)):
                        bad.append(i)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join()
    done.set()
    threads[2].join()
    assert bad == [] and reader.counters["dropped"] == 0
    assert all(same(reader.get_many([H(i)])[0][0], block(i)) for i in range(1, n + 1))


def test_a_reader_racing_a_writer_process_never_sees_a_partial_entry(tmp_path):
    import subprocess
    import sys

    n = 60
    code = ("import sys; sys.path.insert(0, {root!r})\n"
            "from tests.runtime.test_page_store import IDENT, H, block\n"
            "from tinyserve_trt.runtime.kvstore.disk import DiskPageStore\n"
            "from tinyserve_trt.runtime.kvstore.block import entry_size\n"
            "s = DiskPageStore(IDENT, {dir!r}, 1000 * entry_size(IDENT))\n"
            "for i in range(1, {n} + 1):\n    s.put(H(i), block(i))\n").format(
        root=str(__import__("pathlib").Path(__file__).resolve().parents[2]), dir=str(tmp_path), n=n)
    reader = disk(tmp_path, entries=1000)
    writer = subprocess.Popen([sys.executable, "-c", code])
    seen, bad = set(), []
    while writer.poll() is None or len(seen) < n:
        for i in range(1, n + 1):
            for b, _ in reader.get_many([H(i)]):
                seen.add(i)
                if not same(b, block(i)):
                    bad.append(i)
        if writer.poll() is not None and len(seen) < n:
            assert writer.returncode == 0
            continue
    assert bad == [] and reader.counters["dropped"] == 0 and seen == set(range(1, n + 1))


def test_a_background_writer_serves_queued_entries_and_publishes_them_by_close(tmp_path, monkeypatch):
    store = DiskPageStore(IDENT, tmp_path, 100 * entry_size(IDENT), background=True, max_pending=4)
    gate = threading.Event()
    from tinyserve_trt.runtime.kvstore import disk as disk_module
    real = disk_module.publish
    monkeypatch.setattr(disk_module, "publish", lambda *a: gate.wait(10) and real(*a))
    assert store.put(H(1), block(1)) and not store.put(H(1), block(1))
    assert store.contains(H(1)) and not store.path(H(1)).exists()  # queued, not on disk yet
    assert same(store.get_many([H(1)])[0][0], block(1))  # served from the queue meanwhile
    gate.set()
    store.put(H(2), block(2))
    store.close()  # drains the queue
    assert store.path(H(1)).exists() and store.path(H(2)).exists() and store.counters["puts"] == 2
    fresh = disk(tmp_path)
    assert [same(b, block(i)) for (b, _), i in zip(fresh.get_many([H(1), H(2)]), (1, 2))] == [True, True]


def test_a_background_write_that_fails_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    store = DiskPageStore(IDENT, tmp_path, 100 * entry_size(IDENT), background=True)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, "tinyserve.kvstore"):
        store.put(H(1), block(1))
        store.wait()
    monkeypatch.undo()
    assert store.counters["skipped"] == 1 and not store.contains(H(1)) and any("disk full" in r.message
                                                                               for r in caplog.records)
    assert not list(tmp_path.rglob("*.tmp"))
    store.put(H(2), block(2))
    store.close()
    assert store.contains(H(2))
