// One decode step of QueryAwareSparseAttention on CPU over the pool's threads, free of ONNX Runtime
// types: each task's selection (qsa_decode_math.h's HeadStep), the K/V rows it keeps (hot, or cold
// dequantized) with the query heads that keep each, their attention (qsa_attend.h) and the
// selected_pages output. qsa_decode_cpu.cpp validates shapes and page ids before calling run().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "qsa_attend.h"
#include "qsa_cold.h"
#include "qsa_decode_math.h"
#include "qsa_problem.h"
#include "qsa_thread_pool.h"

namespace qsa {

// s.unit_heads [n * r] from a HeadStep per query head of task t (masked: bit g for head g0 + g), or
// from one shared selection (every bit).
inline void select_each(const Problem& p, const Attrs& a, Scratch& s, const Task& t, bool masked) {
  for (int64_t g = 0; g < (masked ? t.gn : 1); ++g) {
    HeadStep step(p, a, s, masked ? Task{t.b, t.h, t.g0 + g, 1} : t);
    step.select();
    if (g == 0) s.unit_heads.assign(step.units(), 0);
    const uint64_t bit = masked ? uint64_t{1} << g : ~uint64_t{0};
    for (int64_t u = 0; u < step.units(); ++u)
      if (step.keep()[u]) s.unit_heads[u] |= bit;
  }
}

// Task t's selection: one shared by its query heads, or with group_reduce "head" one per query head
// (each its own HeadStep over the same page metadata, which the first leaves in cache); then the
// kept K/V rows (logical order) into `rows` - with per-head selections each head's own list - and
// the attended pages (any head's) marked in sel [NP] (if not null).
inline void select_rows(const Problem& p, const Attrs& a, Scratch& s, const Task& t, Rows& rows, bool* sel) {
  const bool masked = a.per_head && t.gn > 1;
  if (!masked || !HeadStep(p, a, s, t).select_heads(s.unit_heads)) select_each(p, a, s, t, masked);
  const int64_t units = static_cast<int64_t>(s.unit_heads.size()), lists = masked ? t.gn : 1;
  const int64_t past = p.past[t.b], D = p.D;
  const int32_t* pages = p.table + t.b * p.NP;
  // the lists a unit's rows go to: its heads' (bit g: head g0 + g), or the one list of every head
  auto lists_of = [&](int64_t u) { return masked ? s.unit_heads[u] : uint64_t{s.unit_heads[u] != 0}; };
  // the rows counted first (each list's, and the cold ones: their buffer is sized before any
  // pointer into it is taken), then written by index: a push_back's capacity check per row was a
  // third of this function's samples, and one list per head spares attending a gather per head
  // over the union of their rows. The same pass marks the attended pages.
  if (sel) std::fill(sel, sel + p.NP, false);
  int64_t at[kMaxUnionHeads] = {}, n_cold = 0;  // each list's row count, then where its next row goes
  for (int64_t u = 0; u < units; ++u) {
    const uint64_t heads = lists_of(u);
    if (!heads) continue;
    if (sel) sel[u / p.r] = true;
    const int64_t tokens = std::min((u + 1) * p.sp, past) - u * p.sp;
    for (uint64_t m = heads; m; m &= m - 1) at[__builtin_ctzll(m)] += tokens;
    if (p.cold.Pc && pages[u / p.r] >= p.P) n_cold += tokens;
  }
  int64_t n_rows = 0;
  rows.head_start.resize(masked ? lists + 1 : 0);
  for (int64_t g = 0; g < lists; ++g) {
    const int64_t count = at[g];
    at[g] = n_rows;
    if (masked) rows.head_start[g] = n_rows;
    n_rows += count;
  }
  if (masked) rows.head_start[lists] = n_rows;
  rows.k.resize(n_rows), rows.v.resize(n_rows);
  rows.cold.resize(2 * n_cold * D);
  const float **rk = rows.k.data(), **rv = rows.v.data();
  float *ck = rows.cold.data(), *cv = ck + n_cold * D;
  ColdRows cold(p, a.cold_int4, s.cold);
  for (int64_t u = 0; u < units; ++u) {
    const uint64_t heads = lists_of(u);
    if (!heads) continue;
    const int64_t page = u / p.r, first = u * p.sp, last = std::min(first + p.sp, past), id = pages[page];
    const float *k0, *v0;  // the unit's first K and V rows; the others follow D floats apart
    if (id < p.P) {
      const int64_t base = (id * p.Hkv + t.h) * p.ps - page * p.ps;
      k0 = p.kc + (base + first) * D, v0 = p.vc + (base + first) * D;
    } else {
      cold.rows(id, t.h, first - page * p.ps, last - page * p.ps, ck, cv);
      k0 = ck, v0 = cv, ck += (last - first) * D, cv += (last - first) * D;
    }
    for (uint64_t m = heads; m; m &= m - 1) {
      const int64_t g = __builtin_ctzll(m);
      const float **hk = rk + at[g], **hv = rv + at[g];
      for (int64_t i = 0; i < last - first; ++i) hk[i] = k0 + i * D, hv[i] = v0 + i * D;
      at[g] += last - first;
    }
  }
}

// The selected_pages rows of a call's tasks: the output's own rows for group tasks; with a task per
// query head (head_tasks: the query heads of a group run on different threads) a row per task in
// `marks`, OR-ed into the output's group rows by finish().
class SelectedRows {
 public:
  SelectedRows(const Problem& p, const Attrs& a) : p_(p), per_head_(head_tasks(p, a) && p.selected) {
    if (!per_head_) return;
    thread_local std::unique_ptr<bool[]> marks;
    thread_local int64_t size = 0;
    const int64_t need = p.B * p.H * p.NP;
    try {
      if (need > size) marks.reset(new bool[need]), size = need;
    } catch (...) {
      return;  // failed(): nothing may throw into ORT
    }
    marks_ = marks.get();
  }
  bool failed() const { return per_head_ && !marks_; }
  bool* row(const Task& t) const {
    if (!p_.selected) return nullptr;
    if (!per_head_) return p_.selected + (t.b * p_.Hkv + t.h) * p_.NP;
    return marks_ + ((t.b * p_.H + t.h * p_.G + t.g0) * p_.NP);
  }
  void finish() const {
    if (!per_head_) return;
    for (int64_t bh = 0; bh < p_.B * p_.Hkv; ++bh) {
      bool* out = p_.selected + bh * p_.NP;
      const bool* m = marks_ + bh * p_.G * p_.NP;
      for (int64_t i = 0; i < p_.NP; ++i) {
        bool any = false;
        for (int64_t g = 0; g < p_.G; ++g) any = any || m[g * p_.NP + i];
        out[i] = any;
      }
    }
  }

 private:
  const Problem& p_;
  const bool per_head_;
  bool* marks_ = nullptr;
};

// attend_part over chunk c of `chunks` of a task's kept rows (the new token with the last chunk):
// of every row for all the task's heads, or with per-head lists (rows.head_start) of each query
// head's own rows, its part at part + g * (2 + D). One head at a time: a block of the union for all
// heads (each row read once) spent more on the other heads' rows than it saved
// (benchmarks/results/native_op_cpu.md, session 20).
inline void attend_rows(const Problem& p, const Attrs& a, const Task& task, const Rows& rows, int64_t c, int64_t chunks,
                        std::vector<float>& logits, float* part) {
  auto slice = [c, chunks](int64_t s0, int64_t s1, int64_t& begin) {
    begin = s0 + (s1 - s0) * c / chunks;
    return s0 + (s1 - s0) * (c + 1) / chunks - begin;
  };
  int64_t begin;
  if (rows.head_start.empty()) {
    const int64_t n = slice(0, static_cast<int64_t>(rows.k.size()), begin);
    return attend_part(p, a, task, rows.k.data() + begin, rows.v.data() + begin, n, c == chunks - 1, logits, part);
  }
  for (int64_t g = 0; g < task.gn; ++g) {
    const int64_t n = slice(rows.head_start[g], rows.head_start[g + 1], begin);
    attend_part(p, a, Task{task.b, task.h, task.g0 + g, 1}, rows.k.data() + begin, rows.v.data() + begin, n,
                c == chunks - 1, logits, part + g * (2 + p.D));
  }
}

// Whether sequence b's decode step selects (a rule that keeps every unit attends them all: dense).
inline bool row_selects(const Problem& p, const Attrs& a, int64_t b) {
  if (a.dense) return false;
  const int64_t past = p.past[b], n = (past + p.ps - 1) / p.ps;
  if (p.r == 1) return !qsa_math::page_rule(n, p.budget[b], p.ps, a.sink_pages, a.recent_pages).all;
  return !qsa_math::sub_page_rule(n, past, p.budget[b], p.ps, p.sp, a.candidate_share, a.sink_pages, a.recent_pages)
              .all;
}

// Every task of the call (Task: a (sequence, KV head), or per query head) over the pool's threads.
// With fewer than 2 of them per thread (batch 1), the selection runs one task each and the
// attention splits each one's kept rows into chunks, merged after; a thread starts on a selected
// task's chunks while another still selects. Returns false when a task could
// not allocate its scratch (nothing may throw into ORT or out of a pool thread).
inline bool run(const Problem& p, const Attrs& attrs) {
  // Per-query-head tasks only when a row selects: a dense step (short contexts, budget 0) attends
  // every row either way, and one task per group reads each K/V row once for its G queries.
  Attrs a = attrs;
  if (a.per_head) {
    bool any = false;
    for (int64_t b = 0; b < p.B && !any; ++b) any = row_selects(p, a, b);
    a.per_head = any;
  }
  std::atomic<bool> ok{true};
  const int64_t tasks = num_tasks(p, a), threads = pool_size(), part_size = task_of(p, a, 0).gn * (2 + p.D);
  auto guarded = [&ok](auto&& fn) {
    return [&ok, fn](int64_t i) {
      try {
        fn(i);
      } catch (...) {
        ok = false;
      }
    };
  };
  const SelectedRows sel(p, a);
  if (sel.failed()) return false;
  if (threads == 1 || tasks >= 2 * threads) {
    parallel_for(tasks, guarded([&](int64_t i) {
      thread_local Scratch s;
      const Task t = task_of(p, a, i);
      select_rows(p, a, s, t, s.rows, sel.row(t));
      s.part.resize(part_size);
      attend_rows(p, a, t, s.rows, 0, 1, s.logits, s.part.data());
      merge_parts(p, t, s.part.data(), 1);
    }));
    if (ok) sel.finish();
    return ok;
  }
  const int64_t chunks = (2 * threads + tasks - 1) / tasks;
  // The calling thread's buffers, named by reference: inside the lambdas a thread_local name
  // would be each worker's own.
  thread_local std::vector<Rows> call_rows;
  thread_local std::vector<float> call_parts;
  auto& rows = call_rows;
  auto& parts = call_parts;
  std::unique_ptr<std::atomic<bool>[]> selected;
  try {
    rows.resize(tasks), parts.resize(tasks * chunks * part_size);
    selected.reset(new std::atomic<bool>[tasks]);
  } catch (...) {
    return false;
  }
  for (int64_t i = 0; i < tasks; ++i) selected[i].store(false, std::memory_order_relaxed);
  // One worker per thread claims the items in order from one counter: the tasks' selections, then
  // each task's attention chunks, a chunk waiting for its task's selection. A thread done with its
  // selections attends the tasks already selected (3 KV heads on 2 threads: in two phases one
  // thread idled for a third of the selections). In order from any pool: a waited-for item was
  // claimed earlier, by a worker that does not wait on a later one (no deadlock, even serially).
  std::atomic<int64_t> next{0};
  const int64_t items = tasks + tasks * chunks;
  parallel_for(threads, [&](int64_t) {
    thread_local Scratch tls;
    Scratch& s = tls;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      if (i < tasks) {
        try {
          const Task t = task_of(p, a, i);
          select_rows(p, a, s, t, rows[i], sel.row(t));
        } catch (...) {
          ok = false;
        }
        selected[i].store(true, std::memory_order_release);
        continue;
      }
      const int64_t task = (i - tasks) / chunks, c = (i - tasks) % chunks;
      while (!selected[task].load(std::memory_order_acquire)) spin_pause();
      if (!ok) continue;
      try {
        attend_rows(p, a, task_of(p, a, task), rows[task], c, chunks, s.logits, parts.data() + (i - tasks) * part_size);
      } catch (...) {
        ok = false;
      }
    }
  }, 1);
  if (ok) {
    for (int64_t task = 0; task < tasks; ++task)
      merge_parts(p, task_of(p, a, task), parts.data() + task * chunks * part_size, chunks);
    sel.finish();
  }
  return ok;
}

}  // namespace qsa
