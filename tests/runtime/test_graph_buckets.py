import numpy as np
import pytest

from tinyserve_trt.runtime.backends.graph_buckets import DecodeBuckets, check_profile
from tinyserve_trt.runtime.batch import ScheduledBatch
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.sequence import Sequence

PAGE_SIZE = 4


def decode_batch(lengths, budget=64):
    """A decode batch: row i has ``lengths[i]`` tokens, all but the last cached, on distinct pages."""
    rows, next_page = [], 1
    for i, n in enumerate(lengths):
        pages = list(range(next_page, next_page + -(-n // PAGE_SIZE)))
        next_page += len(pages)
        tokens = [(7 * i + t) % 50 + 1 for t in range(n)]
        seq = Sequence(f"r{i}", tokens[:1], SamplingParams(), token_ids=tokens, pages=pages,
                       num_cached_tokens=n - 1)
        rows.append((seq, 1))
    return ScheduledBatch.build(rows, PAGE_SIZE, budget)


@pytest.mark.parametrize("max_batch, sizes", [(1, (1,)), (8, (1, 2, 4, 8)), (12, (1, 2, 4, 8, 12)),
                                              (64, (1, 2, 4, 8, 16, 32, 64)),
                                              (100, (1, 2, 4, 8, 16, 32, 64, 100))])
def test_batch_sizes_capped_at_max_batch(max_batch, sizes):
    assert DecodeBuckets(max_batch, 16).batch_sizes == sizes


@pytest.mark.parametrize("max_pages, widths", [(1, (1,)), (2, (1, 2)), (5, (1, 2, 4, 5)),
                                               (512, tuple(1 << i for i in range(10)))])
def test_widths_are_powers_of_two_capped_at_max_pages(max_pages, widths):
    assert DecodeBuckets(8, max_pages).widths == widths


@pytest.mark.parametrize("batch, pages, want", [
    (1, 1, (1, 1)), (2, 2, (2, 2)), (3, 3, (4, 4)), (4, 5, (4, 8)), (5, 8, (8, 8)), (9, 9, (12, 16)),
    (12, 17, (12, 20)), (12, 20, (12, 20)),
])
def test_shape_is_the_smallest_bucket_that_fits(batch, pages, want):
    assert DecodeBuckets(12, 20).shape(batch, pages) == want


@pytest.mark.parametrize("batch, pages", [(13, 1), (1, 21), (13, 21)])
def test_above_the_profile_raises_the_backends_one_line_error(batch, pages):
    with pytest.raises(RuntimeError) as got:
        DecodeBuckets(12, 20).shape(batch, pages)
    with pytest.raises(RuntimeError) as plain:
        check_profile(batch, pages, 12, 20)
    assert str(got.value) == str(plain.value)
    assert str(got.value) == (f"batch {batch} x {pages} pages is outside the engine's profile (12 x 20); "
                              "lower max_batch or re-export")
    assert "\n" not in str(got.value)


def test_check_profile_accepts_the_maximum():
    check_profile(12, 20, 12, 20)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_config_rejects_bad_limits(bad):
    with pytest.raises(ValueError, match="max_batch"):
        DecodeBuckets(bad, 4)
    with pytest.raises(ValueError, match="max_pages"):
        DecodeBuckets(4, bad)


def test_shape_rejects_empty():
    with pytest.raises(ValueError, match="batch >= 1"):
        DecodeBuckets(4, 4).shape(0, 1)


def test_pad_copies_real_rows_and_pads_rows_and_columns():
    batch = decode_batch([9, 3, 14])  # pages per row: 3, 1, 4 -> table width 4
    snapshot = {k: v.copy() for k, v in vars(batch).items() if isinstance(v, np.ndarray)}
    padded = DecodeBuckets(8, 16).pad(batch)
    assert padded.shape == (4, 4)
    n = len(batch)
    assert padded.real.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(padded.input_ids[:n], batch.input_ids)
    np.testing.assert_array_equal(padded.positions[:n], batch.positions)
    np.testing.assert_array_equal(padded.page_table[:n], batch.page_table)
    np.testing.assert_array_equal(padded.past_lens[:n], batch.past_lens)
    np.testing.assert_array_equal(padded.token_budget[:n], batch.token_budget)
    # padding row: token 0, position 0, nothing cached, dense, all page 0
    assert padded.input_ids[n:].tolist() == [[0]] and padded.positions[n:].tolist() == [[0]]
    assert padded.past_lens[n:].tolist() == [0] and padded.token_budget[n:].tolist() == [0]
    assert padded.page_table[n:].tolist() == [[0, 0, 0, 0]]
    assert padded.logits_index.tolist() == [0, 0, 0, 0] and padded.logits_index.dtype == np.int64
    for name in ("input_ids", "positions", "page_table", "past_lens", "token_budget"):
        assert getattr(padded, name).dtype == np.int32, name
    for name, before in snapshot.items():  # pad does not modify the batch
        np.testing.assert_array_equal(getattr(batch, name), before)


def test_pad_columns_are_page_zero():
    batch = decode_batch([5, 21])  # widths 2 and 6 -> table width 6, bucket 8
    padded = DecodeBuckets(2, 8).pad(batch)
    assert padded.shape == (2, 8) and padded.real.all()
    assert padded.page_table.tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 0, 0]]
    assert padded.past_lens.tolist() == [4, 20]
    assert padded.positions.tolist() == [[4], [20]]


def test_pad_exact_bucket_is_unchanged():
    batch = decode_batch([4, 8])  # widths 1 and 2
    padded = DecodeBuckets(4, 4).pad(batch)
    assert padded.shape == (2, 2) and padded.real.all()
    np.testing.assert_array_equal(padded.page_table, batch.page_table)


def test_pad_refuses_prefill_and_oversized_batches():
    batch = decode_batch([9, 3])
    wide = ScheduledBatch(batch.seqs, np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int32),
                          np.full(2, 3, np.int32), batch.past_lens, batch.page_table, np.zeros((2, 3), np.int64),
                          batch.token_budget, batch.sample_mask)
    with pytest.raises(ValueError, match="decode batches"):
        DecodeBuckets(8, 16).pad(wide)
    with pytest.raises(RuntimeError, match=r"batch 2 x 3 pages is outside the engine's profile \(1 x 16\)"):
        DecodeBuckets(1, 16).pad(batch)
    with pytest.raises(RuntimeError, match=r"batch 2 x 3 pages .* \(8 x 2\)"):
        DecodeBuckets(8, 2).pad(batch)


def test_every_batch_the_profile_admits_has_a_bucket():
    buckets = DecodeBuckets(12, 20)
    for b in range(1, 13):
        for w in range(1, 21):
            bb, ww = buckets.shape(b, w)
            assert b <= bb <= 12 and w <= ww <= 20
            assert bb in buckets.batch_sizes and ww in buckets.widths
