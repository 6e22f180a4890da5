// Decode attention (S == 1) over the pages the select kernel kept: split-K
// flash-decoding built to stream K/V at memory bandwidth.
//
// CPU reference: tinyserve_trt/ops/reference.py::sparse_attention_ref (softmax
// over the kept cached tokens plus the new token); tests/kernels compare with it.
//
// Shape of the work:
// * grid (splits, U * gchunks, B): one block per (split of the kept list,
//   selection unit, chunk of <= QSA_MAX_GROUP_PER_BLOCK of the unit's query heads).
//   A unit shared by a GQA group (U = Hkv) reads each K/V row once for the whole
//   group; with group_reduce head every query head is its own unit (U = H, one head,
//   gchunks = 1) and reads the K/V rows of its own kept list.
// * A K/V row is read as 16-byte vectors: LPT lanes cover one row (lane l holds
//   vectors l, l + LPT, ...), so a warp reads 32 / LPT rows at once, each lane
//   issuing 16-byte loads; the q.k dot product is a log2(LPT)-step shuffle
//   reduction inside the lane group (was: one row per warp, 5 steps, 4-byte loads).
// * Each lane group keeps its own online-softmax state (m, l, acc) per query
//   head; at the end the groups of a warp merge by shuffles and the warps
//   through shared memory. Each split writes (m, l, unnormalised acc) to the
//   workspace and combine_kernel merges the splits; split 0 also attends the
//   new token (its K/V are inputs, not yet in the cache).
// * The kept list (select kernels) holds whole pages, or with two-level
//   selection sub-pages of sp contiguous rows; the loop walks it in unit-sized
//   runs of rows either way, so the loads and the math do not change.
// * Cold pages (INT8 or packed INT4 tier) are read element-wise as q * scale into
//   the same lane layout; the rest of the step is the hot path's code.
// Plain loads only (no cp.async, no tensor cores), so the CPU emulation runs
// exactly this code.
//
// Bytes moved per (sequence, unit): kept_tokens * 2 * D * sizeof(T) of K/V
// (int8 or int4 + scales for cold pages) + nq * D * sizeof(T) of queries, plus the
// partials (B * H * splits * (D + 2) * 4, written and read once). Per head that is G
// times the shared K/V bytes at the same budget (each head its own kept tokens).
#include "qsa_common.cuh"

namespace qsa {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxG = QSA_MAX_GROUP_PER_BLOCK;

// Element j of lane-group lane `gl`'s vector v is row element (gl + LPT * v) * VEC + j.
template <typename T, int LPT, int NV>
struct Layout {
    static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte load
    static constexpr int E = NV * VEC;          // elements per lane
    static constexpr int TPW = 32 / LPT;        // rows a warp holds at once
    __device__ static int elem(int gl, int e) { return (gl + LPT * (e / VEC)) * VEC + e % VEC; }
};

// One row of D elements into the lane's registers (0 past D): 16-byte loads when the
// row is 16-byte aligned and D fills whole vectors, else element by element.
template <typename T, int LPT, int NV>
__device__ __forceinline__ void load_row_vec(const T* __restrict__ x, float (&r)[NV * Layout<T, LPT, NV>::VEC],
                                             int D, int gl, bool vec_ok) {
    using L = Layout<T, LPT, NV>;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        const int e0 = (gl + LPT * v) * L::VEC;
        if (vec_ok && e0 < D) {
            alignas(16) T t[L::VEC];
            load16(t, x + e0);
#pragma unroll
            for (int j = 0; j < L::VEC; ++j) r[v * L::VEC + j] = to_f(t[j]);
        } else {
#pragma unroll
            for (int j = 0; j < L::VEC; ++j) r[v * L::VEC + j] = e0 + j < D ? to_f(x[e0 + j]) : 0.f;
        }
    }
}

// Row `off` of page id `page`, KV head h, as fp32 K and V. False for an id in no
// tier (the select kernel flags those). CF: the call's cold format (kColdInt8 or
// kColdInt4), or kNoCold, which compiles the cold branch out (it costs registers).
template <typename T, int LPT, int NV, int CF>
__device__ __forceinline__ bool load_kv(const QsaForwardParams& p, int page, int h, int off, int gl, bool vec_ok,
                                        float (&kr)[NV * Layout<T, LPT, NV>::VEC],
                                        float (&vr)[NV * Layout<T, LPT, NV>::VEC]) {
    using L = Layout<T, LPT, NV>;
    const QsaDims& d = p.dims;
    const int D = d.head_dim, ps = d.page_size, Hkv = d.num_kv_heads;
    if (page >= 0 && page < d.num_pages) {
        const size_t base = ((size_t(page) * Hkv + h) * ps + off) * D;
        load_row_vec<T, LPT, NV>(static_cast<const T*>(p.key_cache) + base, kr, D, gl, vec_ok);
        load_row_vec<T, LPT, NV>(static_cast<const T*>(p.value_cache) + base, vr, D, gl, vec_ok);
        return true;
    }
    if constexpr (CF == kNoCold) {
        return false;
    } else {
        const int c = page - d.num_pages;
        if (p.key_cache_int8 == nullptr || page < 0 || c >= p.cold.num_pages) return false;
        const size_t page_head = size_t(c) * Hkv + h, row = page_head * ps + off;
        const ScaleView ksv = scale_view(p.key_scale, p.cold.key_scale_tokens, p.cold.key_scale_channels, D);
        const ScaleView vsv = value_scale_view<CF>(p, D);
#pragma unroll
        for (int e = 0; e < L::E; ++e) {
            const int dd = L::elem(gl, e);
            kr[e] = dd < D ? cold_key<T, CF>(p, ksv, page, h, page_head, row, off, D, dd) : 0.f;
            vr[e] = dd < D ? cold_v<CF>(p, vsv, page_head, row, off, D, dd) : 0.f;
        }
        return true;
    }
}

// Online-softmax state of one lane group for up to kMaxG query heads.
template <int E>
struct GroupState {
    float q[kMaxG][E];  // pre-multiplied by the softmax scale
    float m[kMaxG], l[kMaxG], acc[kMaxG][E];

    __device__ void init() {
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
            m[g] = -INFINITY;
            l[g] = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
        }
    }

    // Every lane of the warp calls this together (the shuffles); `valid` is false
    // for a lane group whose row does not exist (its state is left unchanged).
    template <int LPT>
    __device__ void update(const float (&kr)[E], const float (&vr)[E], int ng, bool valid) {
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
            if (g < ng) {  // ng is block-uniform
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) s += q[g][e] * kr[e];
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (valid) {
                    const float m_new = fmaxf(m[g], s);
                    const float corr = expf(m[g] - m_new);  // m = -inf the first time: 0
                    const float pr = expf(s - m_new);
                    l[g] = l[g] * corr + pr;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + pr * vr[e];
                    m[g] = m_new;
                }
            }
        }
    }

    // Merge the warp's TPW lane groups into every group (shuffles across groups).
    template <int LPT>
    __device__ void merge_groups(int ng) {
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
            if (g < ng) {
#pragma unroll
                for (int o = LPT; o < 32; o <<= 1) {
                    const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
                    const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
                    const float M = fmaxf(m[g], mo);
                    const float a = M == -INFINITY ? 0.f : expf(m[g] - M);
                    const float b = M == -INFINITY ? 0.f : expf(mo - M);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                        acc[g][e] = acc[g][e] * a + ao * b;
                    }
                    l[g] = l[g] * a + lo * b;
                    m[g] = M;
                }
            }
        }
    }
};

template <typename T, int LPT, int NV, int CF>
__global__ void __launch_bounds__(kWarps * 32)
    decode_split_kernel(QsaForwardParams p, Workspace ws, int splits, int gchunks) {
    using L = Layout<T, LPT, NV>;
    constexpr int E = L::E, DP = LPT * E;  // DP: D padded to the lane layout
    __shared__ float sm_m[kWarps][kMaxG], sm_l[kWarps][kMaxG];
    __shared__ float sm_acc[kWarps][kMaxG][DP];
    const QsaDims& d = p.dims;
    const int split = blockIdx.x, gc = blockIdx.y % gchunks, b = blockIdx.z;
    const SelectUnit unit = select_unit(p, b, blockIdx.y / gchunks);
    const int D = d.head_dim, ps = d.page_size, NP = d.table_width, Hkv = d.num_kv_heads, h = unit.kv_head;
    const int G = d.num_heads / Hkv, g0 = unit.q_head - h * G + gc * kMaxG;  // g0: first head within the group
    const int ng = min(kMaxG, unit.nq - gc * kMaxG);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gl = lane % LPT, slot = lane / LPT;  // lane within its group; which row of the warp
    const int bh = b * Hkv + h;
    const float scale = p.attrs.scale > 0.f ? p.attrs.scale : rsqrtf(float(D));
    // 16-byte loads need 16-byte rows and bases (cudaMalloc gives 256; a sliced view may not)
    const bool vec_ok = (D % L::VEC) == 0 && (reinterpret_cast<uintptr_t>(p.key_cache) % 16) == 0 &&
                        (reinterpret_cast<uintptr_t>(p.value_cache) % 16) == 0;

    GroupState<E> st;
    st.init();
    const T* q = static_cast<const T*>(p.query) + (size_t(b) * d.num_heads + size_t(h) * G + g0) * D;  // S == 1
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int dd = L::elem(gl, e);
            st.q[g][e] = (g < ng && dd < D) ? to_f(q[size_t(g) * D + dd]) * scale : 0.f;
        }

    const int past = max(p.past_lens[b], 0);
    // The kept list holds units of `us` rows: pages, or sub-pages (two-level). A unit's
    // rows are contiguous in its page, so a lane group's rows stay 16-byte vector loads.
    const int us = kept_unit_tokens(p), upp = ps / us;
    const int32_t* kept = ws.kept_idx + unit.row * ws.kept_width;
    const int cnt = ws.kept_cnt[unit.row];
    const int chunk = (cnt + splits - 1) / splits;
    const int p0 = split * chunk, p1 = min(cnt, p0 + chunk);
    const int ntok = max(p1 - p0, 0) * us;
    constexpr int kRows = kWarps * L::TPW;  // rows the block holds at once
    // Row t0 + (this lane group's index) into kr/vr; false (zeros) when it does not exist.
    auto fetch = [&](int t0, float (&kr)[E], float (&vr)[E]) {
        const int t = t0 + warp * L::TPW + slot;
        bool valid = false;
        if (t < ntok) {
            const int u = kept[p0 + t / us];
            const int lp = upp == 1 ? u : u / upp;  // block-uniform: single-level skips the division
            const int off = (u - lp * upp) * us + t % us;
            if (lp * ps + off < past)  // not the slot tail of the partial last page
                valid = load_kv<T, LPT, NV, CF>(p, p.page_table[size_t(b) * NP + lp], h, off, gl, vec_ok, kr, vr);
        }
        if (!valid)
#pragma unroll
            for (int e = 0; e < E; ++e) kr[e] = vr[e] = 0.f;
        return valid;
    };
    // Software pipelining: the next rows' loads are issued before this rows' math, so
    // two row batches per lane are in flight (the shuffles would otherwise serialise them).
    float kr[E], vr[E];
    bool valid = fetch(0, kr, vr);
    for (int t0 = 0; t0 < ntok; t0 += kRows) {  // trip count uniform over the block: shuffles stay converged
        float kn[E], vn[E];
        const bool next = fetch(t0 + kRows, kn, vn);
        st.template update<LPT>(kr, vr, ng, valid);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            kr[e] = kn[e];
            vr[e] = vn[e];
        }
        valid = next;
    }
    if (split == 0 && warp == kWarps - 1) {  // the new token, not yet in the cache: lane group 0 of one warp
        const size_t base = size_t(bh) * D;  // [B, Hkv, S == 1, D]
        float kr[E], vr[E];
        load_row_vec<T, LPT, NV>(static_cast<const T*>(p.key) + base, kr, D, gl, false);
        load_row_vec<T, LPT, NV>(static_cast<const T*>(p.value) + base, vr, D, gl, false);
        st.template update<LPT>(kr, vr, ng, slot == 0);
    }
    st.template merge_groups<LPT>(ng);

    // warps -> shared memory -> this split's partial state in the workspace
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
            if (gl == 0) {
                sm_m[warp][g] = st.m[g];
                sm_l[warp][g] = st.l[g];
            }
#pragma unroll
            for (int e = 0; e < E; ++e) sm_acc[warp][g][L::elem(gl, e)] = st.acc[g][e];
        }
    }
    __syncthreads();
    const size_t hq0 = size_t(b) * d.num_heads + size_t(h) * G + g0;
    for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
        const int g = i / D, dd = i % D;
        float M = -INFINITY;
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][g]);
        float a = 0.f, l = 0.f;
        if (M != -INFINITY)
            for (int w = 0; w < kWarps; ++w) {
                const float c = expf(sm_m[w][g] - M);
                a += sm_acc[w][g][dd] * c;
                l += sm_l[w][g] * c;
            }
        const size_t slot_i = (hq0 + g) * ws.splits_cap + split;
        ws.part_acc[slot_i * D + dd] = a;
        if (dd == 0) {
            ws.part_m[slot_i] = M;
            ws.part_l[slot_i] = l;
        }
    }
}

// grid (H, B): merge the splits of one query head into output[b, hq, 0, :].
template <typename T>
__global__ void combine_kernel(QsaForwardParams p, Workspace ws, int splits) {
    const int hq = blockIdx.x, b = blockIdx.y, D = p.dims.head_dim;
    const size_t row = size_t(b) * p.dims.num_heads + hq;
    const float* m = ws.part_m + row * ws.splits_cap;
    const float* l = ws.part_l + row * ws.splits_cap;
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, m[s]);
    float L = 0.f;
    for (int s = 0; s < splits; ++s) L += m[s] == -INFINITY ? 0.f : l[s] * expf(m[s] - M);
    const float inv = 1.f / L;  // L > 0: split 0 always holds the new token
    T* out = static_cast<T*>(p.output) + row * D;
    for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s)
            if (m[s] != -INFINITY) a += ws.part_acc[(row * ws.splits_cap + s) * D + dd] * expf(m[s] - M);
        out[dd] = from_f<T>(a * inv);
    }
}

template <typename T, int LPT, int NV>
cudaError_t launch_decode_t(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    const int nq = select_unit(p, 0, 0).nq, gchunks = (nq + kMaxG - 1) / kMaxG;  // per head: nq 1, one chunk
    const dim3 grid(splits, select_units(p) * gchunks, d.batch);
    const auto kernel = p.key_cache_int8 == nullptr                ? decode_split_kernel<T, LPT, NV, kNoCold>
                        : p.cold.format == QSA_COLD_FORMAT_INT4 ? decode_split_kernel<T, LPT, NV, kColdInt4>
                                                                : decode_split_kernel<T, LPT, NV, kColdInt8>;
    const cudaError_t e = launch_kernel(kernel, grid, kWarps * 32, 0, stream, p, ws, splits, gchunks);
    if (e != cudaSuccess) return e;
    return launch_kernel(combine_kernel<T>, dim3(d.num_heads, d.batch), 128, 0, stream, p, ws, splits);
}

// Lanes per row: the smallest of 4, 8, 16, 32 whose 16-byte vectors cover D; D past
// 32 vectors (fp32 D > 128) gives each lane two vectors.
template <typename T>
cudaError_t dispatch(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t s) {
    const int vectors = (p.dims.head_dim * int(sizeof(T)) + 15) / 16;
    if (vectors <= 4) return launch_decode_t<T, 4, 1>(p, ws, splits, s);
    if (vectors <= 8) return launch_decode_t<T, 8, 1>(p, ws, splits, s);
    if (vectors <= 16) return launch_decode_t<T, 16, 1>(p, ws, splits, s);
    if constexpr (sizeof(T) == 2) {  // fp16 D <= QSA_MAX_HEAD_DIM = 256 is at most 32 vectors
        return launch_decode_t<T, 32, 1>(p, ws, splits, s);
    } else {
        if (vectors <= 32) return launch_decode_t<T, 32, 1>(p, ws, splits, s);
        return launch_decode_t<T, 32, 2>(p, ws, splits, s);  // fp32 D in (128, 256]
    }
}

}  // namespace

cudaError_t launch_decode(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t stream) {
    if (p.dtype == QSA_DTYPE_FLOAT16) return dispatch<__half>(p, ws, splits, stream);
    return dispatch<float>(p, ws, splits, stream);
}

}  // namespace qsa
