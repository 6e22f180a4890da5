// g++ emulation stand-in for <cuda_fp16.h>: __half as IEEE binary16 bits with
// round-to-nearest-even conversions (the scalar ones the kernels use).
#pragma once
#include <stdint.h>
#include <string.h>

#include "../cuda_emu.h"

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
    uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  // inf / nan
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            ++e;
            man <<= 1;
        } while (!(man & 0x400u));
        u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    const uint32_t absu = u & 0x7fffffffu;
    if (absu >= 0x7f800000u) return __half{uint16_t(sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u : 0u))};
    if (absu >= 0x477ff000u) return __half{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
    if (absu < 0x38800000u) {                                            // below 2^-14: subnormal or zero
        if (absu < 0x33000000u) return __half{sign};                     // < 2^-25: rounds to zero
        const uint32_t man = (absu & 0x7fffffu) | 0x800000u;
        const int shift = 126 - int(absu >> 23);  // 14..24 -> shift so that the result is man >> (shift)
        const uint32_t r = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        const uint32_t out = r + ((rem > half || (rem == half && (r & 1u))) ? 1u : 0u);
        return __half{uint16_t(sign | out)};
    }
    const uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u);  // round to nearest even on the 13 dropped bits
    return __half{uint16_t(sign | ((r - 0x38000000u) >> 13))};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
