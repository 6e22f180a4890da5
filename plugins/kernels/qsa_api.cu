// extern "C" entry points of libqsa_kernels (declared in qsa_launch.h): check
// the arguments, lay out the workspace, pick decode or prefill, launch.
// No allocation, no synchronisation, no abort: every failure is a QsaStatus.
#include "qsa_common.cuh"

namespace {

bool dims_ok(const QsaDims& d) {
    return d.batch >= 0 && d.num_heads >= 1 && d.num_kv_heads >= 1 && d.num_heads % d.num_kv_heads == 0 &&
           d.new_tokens >= 1 && d.head_dim >= 1 && d.head_dim <= QSA_MAX_HEAD_DIM && d.num_pages >= 1 &&
           d.page_size >= 1 && d.table_width >= 1 && d.num_meta_pages >= d.num_pages && d.sub_pages >= 0 &&
           d.sub_pages <= d.page_size && d.batch <= 65535 &&
           d.num_kv_heads * ((d.num_heads / d.num_kv_heads + QSA_MAX_GROUP_PER_BLOCK - 1) /
                             QSA_MAX_GROUP_PER_BLOCK) <= 65535;
}

bool attrs_ok(const QsaAttrs& a) {
    return a.scale >= QSA_ATTR_SCALE_MIN && a.policy >= 0 && a.policy < QSA_NUM_POLICIES && a.sink_pages >= QSA_ATTR_SINK_PAGES_MIN &&
           a.sink_pages <= QSA_ATTR_SINK_PAGES_MAX && a.recent_pages >= QSA_ATTR_RECENT_PAGES_MIN &&
           a.recent_pages <= QSA_ATTR_RECENT_PAGES_MAX && a.group_reduce >= 0 &&
           a.group_reduce < QSA_NUM_GROUP_REDUCTIONS && a.sub_page_size >= QSA_ATTR_SUB_PAGE_SIZE_MIN &&
           a.sub_page_size <= QSA_ATTR_SUB_PAGE_SIZE_MAX && a.candidate_share >= QSA_ATTR_CANDIDATE_SHARE_MIN &&
           a.candidate_share <= QSA_ATTR_CANDIDATE_SHARE_MAX;  // false for NaN
}

// Two-level selection (schema: sub_page_size divides ps, needs key_sub_bounds, policy
// query_aware - OpAttributes refuses the others): r = ps / sp rows of key_sub_bounds
// per (page, KV head), dims.sub_pages says so, and the pointer is set.
bool two_level_ok(const QsaForwardParams& p) {
    const int32_t sp = p.attrs.sub_page_size, ps = p.dims.page_size;
    if (!qsa::two_level(p.attrs, ps)) return sp == 0 || sp == ps;
    return sp < ps && ps % sp == 0 && p.dims.sub_pages == ps / sp && p.key_sub_bounds != nullptr &&
           p.attrs.policy == QSA_POLICY_QUERY_AWARE;
}

// Selection policies a decode step implements, by schema id (plugins/generated/qsa_schema.h): those
// with "cuda" in native_kernels (ops/policies.py; tests/kernels/test_schema_header.py checks the two agree).
// Any other id, including one a policy gains later, is refused instead of run as another policy.
static_assert(QSA_NUM_POLICIES == 4, "a policy gained a native_id: implement it in qsa_select.cu and here");
bool decode_policy_implemented(int32_t policy) {
    switch (policy) {
        case QSA_POLICY_QUERY_AWARE:
        case QSA_POLICY_WINDOW:
        case QSA_POLICY_DENSE: return true;
        default: return false;  // QSA_POLICY_ORACLE needs the dense scores: reference-only
    }
}

bool dtype_ok(int32_t t) { return t == QSA_DTYPE_FLOAT32 || t == QSA_DTYPE_FLOAT16; }

// The four cold pointers come together; with them, Pcold >= 1, a known format, every
// scale token axis 1 or ps, every channel axis 1 or D (INT4: or D / a power of two,
// with D even; INT4 V holds 2C columns, scales then mins: C such a count), and key_min/key_max
// have a row for every cold id.
bool cold_ok(const QsaForwardParams& p) {
    const int n_set = (p.key_cache_int8 != nullptr) + (p.value_cache_int8 != nullptr) + (p.key_scale != nullptr) +
                      (p.value_scale != nullptr);
    const QsaColdDims& c = p.cold;
    if (n_set == 0) return c.num_pages == 0;
    const int32_t ps = p.dims.page_size, D = p.dims.head_dim;
    const bool int4 = c.format == QSA_COLD_FORMAT_INT4;
    if (c.format != QSA_COLD_FORMAT_INT8 && !int4) return false;
    if (int4 && D % 2) return false;
    auto axis_ok = [](int32_t n, int32_t full) { return n == 1 || n == full; };
    auto channels_ok = [&](int32_t n) { return int4 ? qsa::scale_ch_shift(n, D) >= 0 : axis_ok(n, D); };
    return n_set == 4 && c.num_pages >= 1 && axis_ok(c.key_scale_tokens, ps) && channels_ok(c.key_scale_channels) &&
           axis_ok(c.value_scale_tokens, ps) &&
           (int4 ? c.value_scale_channels % 2 == 0 && channels_ok(c.value_scale_channels / 2)
                 : channels_ok(c.value_scale_channels)) &&
           int64_t(p.dims.num_meta_pages) >= int64_t(p.dims.num_pages) + c.num_pages;
}

}  // namespace

extern "C" {

size_t qsa_workspace_size(const QsaDims* dims) {
    if (!dims || !dims_ok(*dims)) return 0;
    return qsa::layout_workspace(*dims, nullptr).bytes;
}

int32_t qsa_workspace_kept(const QsaDims* dims, size_t* idx_offset, size_t* cnt_offset) {
    if (!dims || !dims_ok(*dims) || !idx_offset || !cnt_offset) return 0;
    char* const base = reinterpret_cast<char*>(size_t(256));  // any aligned non-null base: offsets only
    const qsa::Workspace w = qsa::layout_workspace(*dims, base);
    *idx_offset = size_t(reinterpret_cast<char*>(w.kept_idx) - base);
    *cnt_offset = size_t(reinterpret_cast<char*>(w.kept_cnt) - base);
    return w.kept_width;
}

int32_t qsa_kept_rows(const QsaForwardParams* p) {
    if (!p || !dims_ok(p->dims)) return 0;
    return qsa::select_units(*p);
}

int32_t qsa_num_splits(const QsaDims* dims, int32_t requested, int32_t num_sms) {
    if (!dims || !dims_ok(*dims)) return 1;
    const int32_t cap = qsa::splits_cap(*dims);
    int32_t s = requested;
    if (s <= 0) {  // about two blocks per SM in flight, counted over (sequence, KV head, group chunk)
        const int32_t G = dims->num_heads / dims->num_kv_heads;
        const int64_t base = int64_t(dims->batch > 0 ? dims->batch : 1) * dims->num_kv_heads *
                             ((G + QSA_MAX_GROUP_PER_BLOCK - 1) / QSA_MAX_GROUP_PER_BLOCK);
        const int64_t target = 2 * int64_t(num_sms > 0 ? num_sms : 108);
        s = int32_t((target + base - 1) / base);
    }
    return s < 1 ? 1 : (s > cap ? cap : s);
}

int32_t qsa_forward_splits(const QsaForwardParams* p, int32_t num_sms) {
    if (!p || !dims_ok(p->dims)) return 1;
    QsaDims unit_dims = p->dims;  // blocks per split: one per selection unit (per head: groups of one)
    unit_dims.num_kv_heads = qsa::select_units(*p);
    return qsa_num_splits(&unit_dims, p->num_splits, num_sms);
}

int32_t qsa_check(const QsaForwardParams* p) {
    if (!p || !dims_ok(p->dims) || !attrs_ok(p->attrs) || !dtype_ok(p->dtype)) return QSA_ERR_INVALID_ARGUMENT;
    if (p->dims.batch == 0) return QSA_OK;
    if (!p->query || !p->key || !p->value || !p->key_cache || !p->value_cache || !p->key_min || !p->key_max ||
        !p->page_table || !p->past_lens || !p->token_budget || !p->output)
        return QSA_ERR_INVALID_ARGUMENT;
    if (p->selected_pages && p->selected_pages_elem_size != 1 && p->selected_pages_elem_size != 4)
        return QSA_ERR_INVALID_ARGUMENT;
    if (!cold_ok(*p) || !two_level_ok(*p)) return QSA_ERR_INVALID_ARGUMENT;
    const bool decode = p->dims.new_tokens == 1;
    if (decode && !decode_policy_implemented(p->attrs.policy)) return QSA_ERR_UNSUPPORTED;
    // group_reduce "head": a decode block per query head (grid y of the decode kernel, <= 65535)
    if (qsa::per_head_select(*p) && p->dims.num_heads > 65535) return QSA_ERR_INVALID_ARGUMENT;
    if (decode && qsa::select_query_smem(*p) > qsa::kSelectSmemLimit) return QSA_ERR_UNSUPPORTED;
    return QSA_OK;
}

int32_t qsa_forward(const QsaForwardParams* p, void* workspace, size_t workspace_bytes, void* stream) {
    const int32_t st = qsa_check(p);
    if (st != QSA_OK || p->dims.batch == 0) return st;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->dims.new_tokens > 1) {
        // Prefill attends every valid page; the selection output says so.
        if (p->selected_pages) {
            const qsa::Workspace ws = qsa::layout_workspace(p->dims, workspace);
            if (!workspace || workspace_bytes < ws.bytes) return QSA_ERR_WORKSPACE;
            if (qsa::launch_select(*p, ws, true, s) != cudaSuccess) return QSA_ERR_CUDA;
        }
        return qsa::launch_prefill(*p, s) == cudaSuccess ? QSA_OK : QSA_ERR_CUDA;
    }
    const qsa::Workspace ws = qsa::layout_workspace(p->dims, workspace);
    if (!workspace || workspace_bytes < ws.bytes) return QSA_ERR_WORKSPACE;
    int32_t num_sms = 0;
    if (p->num_splits <= 0) {  // host-side attribute queries: no device work, no sync
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            num_sms = 0;
    }
    const int32_t splits = qsa_forward_splits(p, num_sms);
    if (qsa::launch_select(*p, ws, false, s) != cudaSuccess) return QSA_ERR_CUDA;
    return qsa::launch_decode(*p, ws, splits, s) == cudaSuccess ? QSA_OK : QSA_ERR_CUDA;
}

int32_t qsa_append_kv(const QsaAppendParams* p, void* stream) {
    if (!p || !dtype_ok(p->dtype)) return QSA_ERR_INVALID_ARGUMENT;
    QsaDims d = p->dims;
    d.num_heads = d.num_kv_heads;  // not read by the append kernel
    d.num_meta_pages = d.num_pages;
    if (!dims_ok(d)) return QSA_ERR_INVALID_ARGUMENT;
    if (d.batch == 0) return QSA_OK;
    if (!p->key || !p->value || !p->key_cache || !p->value_cache || !p->key_min || !p->key_max || !p->page_table ||
        !p->past_lens)
        return QSA_ERR_INVALID_ARGUMENT;
    QsaAppendParams q = *p;
    q.dims = d;
    return qsa::launch_append(q, static_cast<cudaStream_t>(stream)) == cudaSuccess ? QSA_OK : QSA_ERR_CUDA;
}

const char* qsa_status_string(int32_t status) {
    switch (status) {
        case QSA_OK: return "ok";
        case QSA_ERR_INVALID_ARGUMENT:
            return "invalid argument (dims, pointers, dtype, attributes, cold tier or two-level sub-page bounds)";
        case QSA_ERR_UNSUPPORTED:
            return "unsupported here (oracle policy on decode, or group*head_dim too large)";
        case QSA_ERR_WORKSPACE: return "workspace smaller than qsa_workspace_size()";
        case QSA_ERR_CUDA: return "CUDA launch failed";
        case QSA_ERR_BAD_PAGE_ID: return "a page id outside the pools (from error_flags)";
        case QSA_ERR_TOO_MANY_PAGES: return "a sequence needs more pages than the page table holds (from error_flags)";
        default: return "unknown status";
    }
}

int32_t qsa_flags_status(int32_t flags) {
    if (flags & QSA_FLAG_BAD_PAGE_ID) return QSA_ERR_BAD_PAGE_ID;
    if (flags & QSA_FLAG_TOO_MANY_PAGES) return QSA_ERR_TOO_MANY_PAGES;
    return QSA_OK;
}

}  // extern "C"
