/* fake_cudart.c — a stand-in CUDA runtime for test_client (loaded through
 * SHARDD_CUDART): IPC opens that succeed on host memory, so what libshardd
 * checks after an open runs on machines without a GPU. The driver's
 * cuMemGetAddressRange_v2 reports the allocation FAKE_CUDART_ALLOC bytes
 * large (default 4096), starting FAKE_CUDART_OFFSET bytes before the
 * opened pointer, or fails with FAKE_CUDART_RANGE_ERR; built with
 * -DFAKE_NO_RANGE it has none. FAKE_CUDART_CLOSES counts closes in a file. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

static _Alignas(256) char arena[1 << 16];

static unsigned long long env_num(const char *name, unsigned long long dflt) {
  const char *v = getenv(name);
  return v && v[0] ? strtoull(v, NULL, 0) : dflt;
}

typedef struct {
  char reserved[64];
} fake_ipc_handle;

int cudaIpcOpenMemHandle(void **ptr, fake_ipc_handle h, unsigned int flags) {
  (void)h;
  (void)flags;
  *ptr = arena + env_num("FAKE_CUDART_OFFSET", 0);
  return 0;
}

int cudaIpcCloseMemHandle(void *ptr) {
  (void)ptr;
  const char *path = getenv("FAKE_CUDART_CLOSES");
  FILE *f = path ? fopen(path, "a") : NULL;
  if (f) {
    fputc('x', f);
    fclose(f);
  }
  return 0;
}

int cudaGetDevice(int *dev) {
  *dev = 0;
  return 0;
}

int cudaSetDevice(int dev) { return dev == 0 ? 0 : 101; }

const char *cudaGetErrorString(int e) { return e ? "fake error" : "no error"; }

#ifndef FAKE_NO_RANGE
int cuMemGetAddressRange_v2(unsigned long long *base, size_t *size,
                            unsigned long long ptr) {
  int err = (int)env_num("FAKE_CUDART_RANGE_ERR", 0);
  if (err)
    return err;
  *base = ptr - env_num("FAKE_CUDART_OFFSET", 0);
  *size = (size_t)env_num("FAKE_CUDART_ALLOC", 4096);
  return 0;
}
#endif
