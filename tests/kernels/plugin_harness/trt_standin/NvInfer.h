// STAND-IN, not TensorRT: see NvInferRuntime.h in this folder.
#pragma once
#include "NvInferRuntime.h"
