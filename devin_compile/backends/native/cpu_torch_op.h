// Shared by the C++ torch op kernels (cpu_*_op.cpp): the dtype codes the C kernels take.
#pragma once
#include <c10/core/ScalarType.h>

// 0 float32, 1 bfloat16, 2 float16; -1: a dtype the C kernels do not serve.
inline int dtype_code(c10::ScalarType t) {
    switch (t) {
        case c10::ScalarType::Float: return 0;
        case c10::ScalarType::BFloat16: return 1;
        case c10::ScalarType::Half: return 2;
        default: return -1;
    }
}
