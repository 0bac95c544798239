/* optim_cuda.cu — the cuda backend's kernels (see optim_cuda.h).
 *
 * All kernels are grid-stride loops in two parts: a vector part over groups
 * of V elements read and written with 16-byte (fp32) or 8/16-byte (16-bit)
 * accesses, used only when the wrapper found every pointer aligned for them,
 * then a scalar tail. Per element they call optim_elem.h, which is optim.c's
 * arithmetic operation by operation with explicit round-to-nearest
 * intrinsics (a multiply-add is fused, __fmaf_rn, exactly where optim.c
 * calls fmaf, and nowhere else), and which the host build runs in
 * tests/unit/test_optim_cuda.c against optim.c itself. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "optim_cuda.h"
#include "optim_elem.h"

namespace {

constexpr int kThreads = 256;
constexpr int kDtF32 = SHARDD__ELEM_F32, kDtBf16 = SHARDD__ELEM_BF16,
              kDtF16 = SHARDD__ELEM_F16;

/* Elements per vector group: 4 fp32 (one float4), 8 16-bit (one uint4). */
template <int DT> struct vec_of {
  static constexpr int V = DT == kDtF32 ? 4 : 8;
};

/* Group j (V elements) of a dtype array, as fp32, with one 16-byte load. */
template <int DT>
__device__ __forceinline__ void loadv(const void *base, size_t j, float *out) {
  if (DT == kDtF32) {
    float4 q = static_cast<const float4 *>(base)[j];
    out[0] = q.x;
    out[1] = q.y;
    out[2] = q.z;
    out[3] = q.w;
  } else {
    uint4 q = static_cast<const uint4 *>(base)[j];
    uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; k++)
      shardd__elem_unpack2(DT, w[k], &out[2 * k], &out[2 * k + 1]);
  }
}

__device__ __forceinline__ size_t gtid() {
  return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t gstride() {
  return (size_t)gridDim.x * blockDim.x;
}

unsigned grid_for(size_t work) {
  size_t b = (work + kThreads - 1) / kThreads;
  if (b < 1)
    b = 1;
  if (b > 8192)
    b = 8192;
  return (unsigned)b;
}

bool aligned(const void *p, size_t a) {
  return p == nullptr || ((uintptr_t)p % a) == 0;
}

/* ---- reduce ------------------------------------------------------------ */

struct srcs_t {
  const void *p[SHARDD__CUDA_REDUCE_MAX_SRC];
};

template <int DT>
__global__ void reduce_kernel(float *acc, srcs_t s, int nsrc, int first,
                              int do_div, float divisor, size_t nvec,
                              size_t n) {
  constexpr int V = vec_of<DT>::V;
  const int k0 = first ? 1 : 0;
  for (size_t j = gtid(); j < nvec; j += gstride()) {
    float a[V], t[V];
    if (first) {
      loadv<DT>(s.p[0], j, a);
    } else {
#pragma unroll
      for (int q = 0; q < V / 4; q++) {
        float4 x = reinterpret_cast<const float4 *>(acc)[j * (V / 4) + q];
        a[4 * q] = x.x;
        a[4 * q + 1] = x.y;
        a[4 * q + 2] = x.z;
        a[4 * q + 3] = x.w;
      }
    }
    for (int k = k0; k < nsrc; k++) {
      loadv<DT>(s.p[k], j, t);
#pragma unroll
      for (int e = 0; e < V; e++)
        a[e] = shardd__elem_acc(a[e], t[e]);
    }
    if (do_div) {
#pragma unroll
      for (int e = 0; e < V; e++)
        a[e] = shardd__elem_div(a[e], divisor);
    }
#pragma unroll
    for (int q = 0; q < V / 4; q++)
      reinterpret_cast<float4 *>(acc)[j * (V / 4) + q] =
          make_float4(a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
  }
  for (size_t i = nvec * V + gtid(); i < n; i += gstride()) {
    float a = first ? shardd__elem_load(DT, s.p[0], i) : acc[i];
    for (int k = k0; k < nsrc; k++)
      a = shardd__elem_acc(a, shardd__elem_load(DT, s.p[k], i));
    if (do_div)
      a = shardd__elem_div(a, divisor);
    acc[i] = a;
  }
}

template <int DT>
cudaError_t launch_reduce(float *acc, const void *const *srcs, int nsrc,
                          int first, int do_div, float divisor, size_t n,
                          cudaStream_t st) {
  constexpr int V = vec_of<DT>::V;
  srcs_t s = {};
  bool al = aligned(acc, 16);
  for (int k = 0; k < nsrc; k++) {
    s.p[k] = srcs[k];
    al = al && aligned(srcs[k], 16);
  }
  size_t nvec = al ? n / V : 0;
  size_t work = nvec > n - nvec * V ? nvec : n - nvec * V;
  reduce_kernel<DT><<<grid_for(work), kThreads, 0, st>>>(
      acc, s, nsrc, first, do_div, divisor, nvec, n);
  return cudaGetLastError();
}

/* ---- sum of squares ---------------------------------------------------- */

__global__ void sumsq_kernel(const float *x, size_t nvec, size_t n,
                             double *partials) {
  __shared__ double sh[kThreads];
  double acc = 0;
  for (size_t j = gtid(); j < nvec; j += gstride()) {
    float4 q = reinterpret_cast<const float4 *>(x)[j];
    acc += (double)q.x * (double)q.x; /* products are exact in double */
    acc += (double)q.y * (double)q.y;
    acc += (double)q.z * (double)q.z;
    acc += (double)q.w * (double)q.w;
  }
  for (size_t i = nvec * 4 + gtid(); i < n; i += gstride())
    acc += (double)x[i] * (double)x[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) { /* fixed tree: deterministic */
    if ((int)threadIdx.x < w)
      sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    partials[blockIdx.x] = sh[0];
}

/* ---- optimizer update -------------------------------------------------- */

__device__ __forceinline__ void ld4(const float *a, size_t j, float *o) {
  float4 q = reinterpret_cast<const float4 *>(a)[j];
  o[0] = q.x;
  o[1] = q.y;
  o[2] = q.z;
  o[3] = q.w;
}

__device__ __forceinline__ void st4(float *a, size_t j, const float *o) {
  reinterpret_cast<float4 *>(a)[j] = make_float4(o[0], o[1], o[2], o[3]);
}

/* PDT: 0 for an fp32 param (p is the param), else the 16-bit dtype p16 is
 * rewritten in from the updated master p. */
template <int PDT>
__global__ void update_kernel(shardd__cuda_upd k, float *p, const float *g,
                              float *m, float *v, float *vmax, uint16_t *p16,
                              size_t nvec, size_t n) {
  for (size_t j = gtid(); j < nvec; j += gstride()) {
    float P[4], G[4], M[4] = {0, 0, 0, 0}, S[4] = {0, 0, 0, 0},
                      X[4] = {0, 0, 0, 0};
    ld4(p, j, P);
    ld4(g, j, G);
    if (m)
      ld4(m, j, M);
    if (v)
      ld4(v, j, S);
    if (vmax)
      ld4(vmax, j, X);
#pragma unroll
    for (int e = 0; e < 4; e++)
      shardd__elem_update(&k, &P[e], G[e], &M[e], &S[e], &X[e]);
    st4(p, j, P);
    if (m)
      st4(m, j, M);
    if (v)
      st4(v, j, S);
    if (vmax)
      st4(vmax, j, X);
    if (PDT) {
      uint2 o;
      o.x = shardd__elem_pack2(PDT, P[0], P[1]);
      o.y = shardd__elem_pack2(PDT, P[2], P[3]);
      reinterpret_cast<uint2 *>(p16)[j] = o;
    }
  }
  for (size_t i = nvec * 4 + gtid(); i < n; i += gstride())
    shardd__elem_update_at(&k, i, p, g, m, v, vmax, PDT, p16);
}

/* ---- widen ------------------------------------------------------------- */

template <int DT>
__global__ void widen_kernel(float *dst, const void *src, size_t nvec,
                             size_t n) {
  constexpr int V = vec_of<DT>::V;
  for (size_t j = gtid(); j < nvec; j += gstride()) {
    float a[V];
    loadv<DT>(src, j, a);
#pragma unroll
    for (int q = 0; q < V / 4; q++)
      reinterpret_cast<float4 *>(dst)[j * (V / 4) + q] =
          make_float4(a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
  }
  for (size_t i = nvec * V + gtid(); i < n; i += gstride())
    dst[i] = shardd__elem_load(DT, src, i);
}

template <int DT>
cudaError_t launch_widen(float *dst, const void *src, size_t n,
                         cudaStream_t st) {
  constexpr int V = vec_of<DT>::V;
  size_t nvec = aligned(dst, 16) && aligned(src, 16) ? n / V : 0;
  size_t work = nvec > n - nvec * V ? nvec : n - nvec * V;
  widen_kernel<DT><<<grid_for(work), kThreads, 0, st>>>(dst, src, nvec, n);
  return cudaGetLastError();
}

/* ---- add, adopt ------------------------------------------------------- */

__global__ void add_kernel(float *acc, const float *x, size_t nvec, size_t n) {
  for (size_t j = gtid(); j < nvec; j += gstride()) {
    float4 a = reinterpret_cast<float4 *>(acc)[j];
    float4 b = reinterpret_cast<const float4 *>(x)[j];
    reinterpret_cast<float4 *>(acc)[j] =
        make_float4(shardd__elem_acc(a.x, b.x), shardd__elem_acc(a.y, b.y),
                    shardd__elem_acc(a.z, b.z), shardd__elem_acc(a.w, b.w));
  }
  for (size_t i = nvec * 4 + gtid(); i < n; i += gstride())
    acc[i] = shardd__elem_acc(acc[i], x[i]);
}

/* Scalar only: a step runs it once over its shard, and each element is one
 * 6-byte read and, rarely, a write. */
template <int DT>
__global__ void adopt_kernel(float *master, const uint16_t *p, size_t n) {
  for (size_t i = gtid(); i < n; i += gstride())
    master[i] = shardd__elem_adopt(DT, master[i], p[i]);
}

} // namespace

extern "C" int shardd__cuda_add(float *acc, const float *x, size_t n,
                                void *stream) {
  if (n == 0)
    return 0;
  size_t nvec = aligned(acc, 16) && aligned(x, 16) ? n / 4 : 0;
  size_t work = nvec > n - nvec * 4 ? nvec : n - nvec * 4;
  add_kernel<<<grid_for(work), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      acc, x, nvec, n);
  return (int)cudaGetLastError();
}

extern "C" int shardd__cuda_adopt(int dtype, float *master,
                                  const void *param16, size_t n,
                                  void *stream) {
  if (n == 0)
    return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint16_t *p = static_cast<const uint16_t *>(param16);
  if (dtype == kDtBf16)
    adopt_kernel<kDtBf16><<<grid_for(n), kThreads, 0, st>>>(master, p, n);
  else if (dtype == kDtF16)
    adopt_kernel<kDtF16><<<grid_for(n), kThreads, 0, st>>>(master, p, n);
  else
    return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}

extern "C" int shardd__cuda_reduce(int dtype, float *acc,
                                   const void *const *srcs, int nsrc,
                                   int first, int do_div, float divisor,
                                   size_t n, void *stream) {
  if (n == 0)
    return 0;
  if (nsrc < 1 || nsrc > SHARDD__CUDA_REDUCE_MAX_SRC)
    return (int)cudaErrorInvalidValue;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
  case kDtF32:
    return (int)launch_reduce<kDtF32>(acc, srcs, nsrc, first, do_div, divisor,
                                      n, st);
  case kDtBf16:
    return (int)launch_reduce<kDtBf16>(acc, srcs, nsrc, first, do_div,
                                       divisor, n, st);
  case kDtF16:
    return (int)launch_reduce<kDtF16>(acc, srcs, nsrc, first, do_div, divisor,
                                      n, st);
  }
  return (int)cudaErrorInvalidValue;
}

extern "C" int shardd__cuda_sumsq(const float *x, size_t n, double *partials,
                                  void *stream) {
  size_t nvec = aligned(x, 16) ? n / 4 : 0;
  sumsq_kernel<<<SHARDD__CUDA_SUMSQ_BLOCKS, kThreads, 0,
                 static_cast<cudaStream_t>(stream)>>>(x, nvec, n, partials);
  return (int)cudaGetLastError();
}

extern "C" int shardd__cuda_update(const shardd__cuda_upd *k, float *p,
                                   const float *g, float *m, float *v,
                                   float *vmax, int dtype, void *param16,
                                   size_t n, void *stream) {
  if (n == 0)
    return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  bool al = aligned(p, 16) && aligned(g, 16) && aligned(m, 16) &&
            aligned(v, 16) && aligned(vmax, 16) && aligned(param16, 8);
  size_t nvec = al ? n / 4 : 0;
  size_t work = nvec > n - nvec * 4 ? nvec : n - nvec * 4;
  uint16_t *p16 = static_cast<uint16_t *>(param16);
  if (p16 == nullptr)
    update_kernel<0><<<grid_for(work), kThreads, 0, st>>>(*k, p, g, m, v, vmax,
                                                          p16, nvec, n);
  else if (dtype == kDtBf16)
    update_kernel<kDtBf16><<<grid_for(work), kThreads, 0, st>>>(
        *k, p, g, m, v, vmax, p16, nvec, n);
  else if (dtype == kDtF16)
    update_kernel<kDtF16><<<grid_for(work), kThreads, 0, st>>>(
        *k, p, g, m, v, vmax, p16, nvec, n);
  else
    return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}

extern "C" int shardd__cuda_widen(int dtype, float *dst, const void *src,
                                  size_t n, void *stream) {
  if (n == 0)
    return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
  case kDtF32:
    return (int)launch_widen<kDtF32>(dst, src, n, st);
  case kDtBf16:
    return (int)launch_widen<kDtBf16>(dst, src, n, st);
  case kDtF16:
    return (int)launch_widen<kDtF16>(dst, src, n, st);
  }
  return (int)cudaErrorInvalidValue;
}
