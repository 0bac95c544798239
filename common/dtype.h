/* dtype.h — element conversions between fp32 and the 16-bit formats the
 * daemon stores (bf16, IEEE fp16). Header-only so the kernels that use them
 * inline and vectorize, and SHARDD_HD (hostdev.h) so the cuda kernels
 * (optim_cuda.cu) run this very code: integer operations only, so host and
 * device agree bit for bit, NaNs included. Rounding is round-to-nearest-even,
 * as torch's .to(torch.bfloat16) / .half() on CPU; NaN stays NaN. */
#ifndef SHARDD_DTYPE_H
#define SHARDD_DTYPE_H

#include <stdint.h>

#include "hostdev.h"

SHARDD_HD float shardd__bf16_to_f32(uint16_t h) {
  return shardd__bits_f32((uint32_t)h << 16);
}

SHARDD_HD uint16_t shardd__f32_to_bf16(float f) {
  uint32_t u = shardd__f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep sign */
    return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* A signalling NaN comes back quiet (payload kept), as from the float
 * arithmetic decode optim.c's shardd__to_f32 uses (torch's), so widening a
 * parameter gives the same bits on every path. */
SHARDD_HD float shardd__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise, the leading 1 to bit 10 */
      uint32_t shift = (uint32_t)shardd__clz32(man) - 21u;
      man = (man << shift) & 0x3ffu;
      u = sign | ((127u - 15u + 1u - shift) << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return shardd__bits_f32(u);
}

SHARDD_HD uint16_t shardd__f32_to_f16(float f) {
  uint32_t u = shardd__f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) /* NaN */
    return (uint16_t)(sign | 0x7e00u);
  if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
    return (uint16_t)(sign | 0x7c00u);
  if (abs < 0x38800000u) { /* below fp16's smallest normal: subnormal */
    if (abs < 0x33000000u) /* below half the smallest subnormal */
      return (uint16_t)sign;
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 13 mantissa bits + how far below 2^-14 */
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u)))
      half++;
    return (uint16_t)(sign | half);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

#endif /* SHARDD_DTYPE_H */
