// One call of QueryAwareSparseAttention on CPU over a validated Problem: a decode step (S == 1,
// qsa_decode_step.h: the selection, then the kept rows) or a prefill chunk (S > 1, qsa_prefill.h:
// exact causal attention over every cached token). Both custom ops of the library call it.
#pragma once

#include "qsa_decode_step.h"
#include "qsa_prefill.h"
#include "qsa_problem.h"

namespace qsa {

// False when a task could not allocate its scratch.
inline bool attend(const Problem& p, const Attrs& a) { return p.S == 1 ? run(p, a) : prefill::run(p, a); }

}  // namespace qsa
