// Harness-only: TensorRT's headers include <cuda_runtime_api.h>; in the CPU emulation that is
// plugins/emulation's cuda_runtime.h (streams are ignored) plus the event type they name.
#pragma once
#include "cuda_runtime.h"
typedef struct CUevent_st* cudaEvent_t;
