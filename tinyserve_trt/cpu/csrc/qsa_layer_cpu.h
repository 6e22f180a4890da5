// tinyserve.cpu::QueryAwareSparseAttentionLayer, the attention layer around the op (qsa_layer_cpu.cpp).
#pragma once

#include "ort_abi.h"

namespace qsa_layer {

const OrtCustomOp* op();

}  // namespace qsa_layer
