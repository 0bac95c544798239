/* hostdev.h — what lets one piece of element arithmetic build both as CUDA
 * device code (optim_cuda.cu) and as plain C on the host (dtype.h's users,
 * tests/unit/test_optim_cuda.c), so the host can run, and test, the very code
 * the kernels run: SHARDD_HD, float <-> bits casts, a leading-zero count,
 * the four separately rounded float operations the optimizers use and the
 * fused multiply-add (one rounding) where torch's CPU kernels fuse.
 *
 * Device: the _rn intrinsics, which nvcc never contracts into an FMA
 * whatever -fmad says, and which keep denormals unless built with -ftz=true
 * (the Makefile's nvcc rule does not, nor --use_fast_math); __fmaf_rn for
 * the fused one.
 *
 * Host: the plain IEEE operations and C99's fmaf (correctly rounded on
 * every target: an instruction where the ISA has one, glibc's exact
 * software fma where it does not), each in a function of its own so that no
 * source expression holds both a multiply and an add (clang, by default,
 * contracts only within one expression). GCC contracts across statements
 * in its GNU dialects and in C++, and so does clang with
 * -ffp-contract=fast, so a host file that calls these must be ISO C for
 * GCC (-std=c11, as the Makefile builds every .c) or say
 * #pragma GCC optimize("fp-contract=off") before including this, and must
 * not be built with clang's -ffp-contract=fast.
 *
 * With that, host and device compute the same bits for every result that is
 * not a NaN. A NaN is a NaN on both but its payload is not the same: sm_90's
 * float operations return the canonical 0x7fffffff, x86's and Arm's return
 * an operand's payload, quieted. Conversions (dtype.h) are integer code and
 * agree bit for bit, NaNs included. */
#ifndef SHARDD_HOSTDEV_H
#define SHARDD_HOSTDEV_H

#include <stdint.h>

#if defined(__CUDACC__)
#define SHARDD_HD static __host__ __device__ __forceinline__
#else
#define SHARDD_HD static inline
#endif

#if !defined(__CUDA_ARCH__)
#include <float.h>
#include <math.h>
#include <string.h>
/* x87-style excess precision would round twice where the device rounds once */
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != -1
#error "hostdev.h needs float arithmetic evaluated in float (FLT_EVAL_METHOD 0)"
#endif
#endif

SHARDD_HD uint32_t shardd__f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

SHARDD_HD float shardd__bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* Leading zero bits of x != 0. */
SHARDD_HD int shardd__clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz((int)x);
#else
  return __builtin_clz(x);
#endif
}

SHARDD_HD float shardd__fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SHARDD_HD float shardd__fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SHARDD_HD float shardd__fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SHARDD_HD float shardd__fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

/* a * b + c with one rounding. */
SHARDD_HD float shardd__ffma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

#endif /* SHARDD_HOSTDEV_H */
