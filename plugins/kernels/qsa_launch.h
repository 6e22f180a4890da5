/* Launch interface of the QueryAwareSparseAttention CUDA kernels.
 *
 * Plain C (no CUDA, no TensorRT types) so that three consumers share it:
 * the TensorRT plugin (plugins/tensorrt/), the Python harness via ctypes
 * (tinyserve_trt/cuda/library.py builds its structs from cuda/launch_abi.py, which
 * also generates the C ones; a CPU test compiles this header with the host C
 * compiler and checks every offset), and tests.
 *
 * Layouts (row-major, named dims as in tinyserve_trt/ops/schema.py):
 *   query [B, H, S, D]   key/value [B, Hkv, S, D]   output [B, H, S, D]
 *   key_cache/value_cache [P, Hkv, ps, D]   key_min/key_max [Ptot, Hkv, D]
 *   page_table [B, NP] int32   past_lens/token_budget [B] int32
 *   selected_pages [B, Hkv, NP] 0/1, one byte (numpy/torch bool) or int32
 *   (TensorRT plugins cannot output kBOOL), per selected_pages_elem_size; may be NULL.
 *   With group_reduce head it marks a page any query head of the KV head's group attends.
 * Float tensors are all float32 or all float16 (`dtype`); accumulation is fp32.
 *
 * Optional cold tier (all four pointers set, or all NULL = hot pages only), in
 * one of two formats (cold.format, QSA_COLD_FORMAT_*; tinyserve_trt/ops/cold_codec.py):
 *   INT8: key_cache_int8/value_cache_int8 [Pcold, Hkv, ps, D] int8,
 *     key_scale [Pcold, Hkv, Tk, Ck] float32, value_scale [Pcold, Hkv, Tv, Cv] float32,
 *     T in {1, ps} and C in {1, D}: one scale broadcast over the page's tokens
 *     and/or channels (K per channel is [.., 1, D], V per token [.., ps, 1]).
 *   INT4 (format 3): the pools are uint8 [Pcold, Hkv, ps, D/2] (D even): channel j < D/2
 *     in the low nibble of byte j, channel j + D/2 in the high one; each nibble q in [0, 15].
 *     Values: q * scale + min (float32, no FMA) with float16 value_scale [Pcold, Hkv, T, 2C]:
 *     columns [0, C) the scales, [C, 2C) the mins, C = 1 or D / C a power of two: channel c
 *     uses column c / (D / C) and C + c / (D / C); value_scale_channels is 2C. Keys:
 *     min(lo + q * step, hi) with step = (hi - lo) * f32(1/15), lo/hi the page's
 *     key_min/key_max or, two-level (0 < sp < ps), the token's sub-page bounds that its
 *     key_sub_bounds code decodes to (prefill reads them too); key_scale
 *     ([Pcold, Hkv, 1, 1], float16) is not read.
 * A page id p in [P, P + Pcold) is cold page p - P, read in fp32. key_min/key_max
 * keep one row per page id, hot (exact) or cold (bounds of what the kernels read)
 * (Ptot >= P + Pcold).
 *
 * Two-level selection (attrs.sub_page_size = sp, 0 < sp < ps, ps % sp == 0;
 * policy query_aware; rule: tinyserve_trt/ops/two_level.py):
 *   key_sub_bounds [Ptot, Hkv, r, D] uint8, r = ps / sp = dims.sub_pages: per
 *   channel, the sub-page's min (low nibble) and max (high nibble) in 4-bit steps
 *   of the page's [key_min, key_max] (tinyserve_trt/ops/fine_bounds.py).
 * A decode step keeps candidate pages by the page score, then sub-pages of the
 * candidates by the decoded bounds, and attends the kept sub-pages only;
 * selected_pages marks a page when any of its sub-pages is attended. sp == 0 or
 * sp == ps is single-level (key_sub_bounds and sub_pages are then not read; an INT4
 * package's codes are then 0, the page bounds).
 *
 * Every entry point returns a QsaStatus and never aborts, allocates, or
 * synchronizes the stream. The kernels read page ids from device memory, so
 * they report bad ones through device memory: a page id outside [0, P + Pcold)
 * (append: [0, P)) sets QSA_FLAG_BAD_PAGE_ID and a sequence needing more than
 * NP pages sets QSA_FLAG_TOO_MANY_PAGES in *error_flags (an int32 the caller
 * zeroes; NULL = not reported); once the stream has run, qsa_flags_status()
 * turns the word into QSA_ERR_BAD_PAGE_ID / QSA_ERR_TOO_MANY_PAGES, as the numpy
 * reference raises on both. The offending reads are skipped, never made out of
 * bounds, and the outputs of a flagged call are unspecified.
 */
#ifndef TINYSERVE_QSA_LAUNCH_H
#define TINYSERVE_QSA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include "../generated/qsa_schema.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum QsaStatus {
    QSA_OK = 0,
    QSA_ERR_INVALID_ARGUMENT = 1, /* a dim, pointer or attribute is out of range */
    QSA_ERR_UNSUPPORTED = 2,      /* valid per the schema, not implemented here (oracle decode) */
    QSA_ERR_WORKSPACE = 3,        /* workspace smaller than qsa_workspace_size() */
    QSA_ERR_CUDA = 4,             /* a launch failed (cudaGetLastError) */
    QSA_ERR_BAD_PAGE_ID = 5,      /* from error_flags: a page id outside the pools */
    QSA_ERR_TOO_MANY_PAGES = 6    /* from error_flags: a sequence needs more than NP pages */
} QsaStatus;

/* Bits of the error_flags word the kernels set (atomicOr). */
#define QSA_FLAG_BAD_PAGE_ID 1
#define QSA_FLAG_TOO_MANY_PAGES 2

typedef enum QsaDtype { QSA_DTYPE_FLOAT32 = 0, QSA_DTYPE_FLOAT16 = 1 } QsaDtype;

/* Largest head dim and GQA group one block handles; larger groups are split
 * across blocks, larger head dims are refused. */
#define QSA_MAX_HEAD_DIM 256
#define QSA_MAX_GROUP_PER_BLOCK 8
/* Upper bound of split-K partitions per (sequence, query head). */
#define QSA_MAX_SPLITS 64

/* QsaDims, QsaAttrs, QsaColdDims, QsaForwardParams, QsaAppendParams: generated from
 * tinyserve_trt/cuda/launch_abi.py, which cuda/library.py builds its ctypes mirror from. */
#include "../generated/qsa_launch_structs.h"

/* Bytes of scratch qsa_forward needs for these dims; sized for the largest
 * split count it may choose and a kept-list row per query head (whatever
 * group_reduce is), so a plugin can size it once from max dims. */
size_t qsa_workspace_size(const QsaDims* dims);

/* Where a decode step leaves its kept list in a workspace laid out for `dims`:
 * int32 kept units at byte *idx_offset ([B, U, width], ascending; unit u is
 * logical page u / r, sub-page u % r; r = 1 single-level) and int32 counts at
 * byte *cnt_offset ([B, U]), U = qsa_kept_rows() rows per sequence (the workspace
 * has room for U = H). Returns width (0 for bad dims). For tests, which
 * read it once the stream has run; the kernels do not need it. */
int32_t qsa_workspace_kept(const QsaDims* dims, size_t* idx_offset, size_t* cnt_offset);

/* Kept-list rows per sequence a decode step with these params writes (selection units):
 * H when each query head selects alone (group_reduce head, policy query_aware, S == 1:
 * row b * H + query head), else Hkv (row b * Hkv + KV head; window and dense select the
 * same units for every head of a group, so head shares them too). 0 for bad dims. */
int32_t qsa_kept_rows(const QsaForwardParams* params);

/* Checks dims and attributes without touching device memory. */
int32_t qsa_check(const QsaForwardParams* params);

/* Decode (S == 1): select pages (per KV head, or with group_reduce head per query head),
 * split-K attention over them, combine.
 * Prefill (S > 1): exact causal attention over every cached page and the new
 * tokens. Asynchronous on `stream` (a cudaStream_t; NULL = legacy default). */
int32_t qsa_forward(const QsaForwardParams* params, void* workspace, size_t workspace_bytes, void* stream);

int32_t qsa_append_kv(const QsaAppendParams* params, void* stream);

const char* qsa_status_string(int32_t status);

/* The status an error_flags word stands for (QSA_OK for 0). */
int32_t qsa_flags_status(int32_t flags);

/* Number of split-K partitions for these dims (0 = auto), counting a block per KV head. */
int32_t qsa_num_splits(const QsaDims* dims, int32_t requested, int32_t num_sms);

/* The split-K partitions qsa_forward's decode uses for params (params->num_splits; 0 = auto):
 * qsa_num_splits over a block per selection unit (qsa_kept_rows: per head, groups of one). */
int32_t qsa_forward_splits(const QsaForwardParams* params, int32_t num_sms);

#ifdef __cplusplus
}
#endif

#endif /* TINYSERVE_QSA_LAUNCH_H */
