/* cuda_ipc.c — CUDA IPC without linking CUDA: the few runtime calls
 * libshardd needs to open a cuda daemon's blocks and pools, resolved from
 * libcudart (and the driver's cuMemGetAddressRange) on first use. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

/* The few runtime calls needed, declared here and resolved from libcudart
 * on first use. cudaIpcMemHandle_t is a struct of 64 bytes passed by value,
 * cudaError_t an int-sized enum; 0 is cudaSuccess. */
#define CUDA_IPC_LAZY_PEER 0x01 /* cudaIpcMemLazyEnablePeerAccess */

typedef struct {
  char reserved[CUDA_IPC_BYTES];
} cuda_ipc_handle;

static struct {
  pthread_once_t once;
  void *lib;
  char why[512];
  int (*ipc_open)(void **ptr, cuda_ipc_handle h, unsigned int flags);
  int (*ipc_close)(void *ptr);
  int (*get_device)(int *dev);
  int (*set_device)(int dev);
  const char *(*error_string)(int e);
} cudart = {PTHREAD_ONCE_INIT, NULL, "", NULL, NULL, NULL, NULL, NULL};

/* Why dlopen() failed, copied at once: the next dl* call overwrites it. */
static void *cudart_open(const char *name, char *why, size_t whylen) {
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *e = dlerror();
    snprintf(why, whylen, "%s", e ? e : "unknown dlopen error");
  }
  return lib;
}

static void cudart_load(void) {
  static const char *names[] = {"libcudart.so", "libcudart.so.13",
                                "libcudart.so.12"};
  char last[256] = "";
  /* Hosts with several CUDA versions pick the runtime matching the
   * daemon's; read once, at the first CUDA handle of the process. */
  const char *env = getenv("SHARDD_CUDART");
  if (env != NULL) {
    /* dlopen("") would hand back the program itself, not a runtime. */
    if (env[0] == '\0') {
      snprintf(cudart.why, sizeof cudart.why,
               "SHARDD_CUDART is set but empty: name the libcudart to load, "
               "or unset it to try libcudart.so, .so.13, .so.12");
      return;
    }
    cudart.lib = cudart_open(env, last, sizeof last);
    if (cudart.lib == NULL) {
      snprintf(cudart.why, sizeof cudart.why,
               "SHARDD_CUDART=%s could not be loaded: %s", env, last);
      return;
    }
  }
  for (size_t i = 0; i < sizeof names / sizeof names[0] && !cudart.lib; i++)
    cudart.lib = cudart_open(names[i], last, sizeof last);
  if (cudart.lib == NULL) {
    snprintf(cudart.why, sizeof cudart.why,
             "libcudart could not be loaded (tried libcudart.so, .so.13, "
             ".so.12; last: %s): install the CUDA runtime, add its folder "
             "to LD_LIBRARY_PATH or name it in SHARDD_CUDART", last);
    return;
  }
  *(void **)&cudart.ipc_open = dlsym(cudart.lib, "cudaIpcOpenMemHandle");
  *(void **)&cudart.ipc_close = dlsym(cudart.lib, "cudaIpcCloseMemHandle");
  *(void **)&cudart.get_device = dlsym(cudart.lib, "cudaGetDevice");
  *(void **)&cudart.set_device = dlsym(cudart.lib, "cudaSetDevice");
  *(void **)&cudart.error_string = dlsym(cudart.lib, "cudaGetErrorString");
  if (!cudart.ipc_open || !cudart.ipc_close || !cudart.get_device ||
      !cudart.set_device || !cudart.error_string) {
    snprintf(cudart.why, sizeof cudart.why,
             "the loaded library (%s) lacks cudaIpcOpenMemHandle and friends: "
             "it is not a CUDA runtime", env ? env : "libcudart");
    dlclose(cudart.lib);
    cudart.lib = NULL;
  }
}

/* The driver's cuMemGetAddressRange, which tells how large the allocation
 * an opened IPC pointer lies in is (the runtime has no call for it): looked
 * up in the runtime first, then in the libcuda.so.1 the runtime loaded to
 * open a handle (RTLD_NOLOAD: this never loads a driver of its own). */
const char shardd__cudart_range_call[] = "cuMemGetAddressRange_v2";

static struct {
  pthread_once_t once;
  int (*get_range)(unsigned long long *base, size_t *size, unsigned long long ptr);
} cudrv = {PTHREAD_ONCE_INIT, NULL};

static void cudrv_load(void) {
  *(void **)&cudrv.get_range = dlsym(cudart.lib, "cuMemGetAddressRange_v2");
  if (cudrv.get_range == NULL) {
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (drv != NULL) /* kept: the runtime holds it for the process's life */
      *(void **)&cudrv.get_range = dlsym(drv, "cuMemGetAddressRange_v2");
  }
}

int shardd__cudart_ready(void) {
  pthread_once(&cudart.once, cudart_load);
  return cudart.lib != NULL;
}

const char *shardd__cudart_str(int e) {
  const char *s = cudart.error_string ? cudart.error_string(e) : NULL;
  return s ? s : "unknown CUDA error";
}

/* Opens handle on device dev (the caller's current device is kept) and
 * says in *avail how many bytes the allocation holds from the pointer on
 * (a block the daemon advertised larger than its memory would let the
 * trainer write past it). On failure *what names the CUDA call that
 * failed and the handle is closed; -1 is "no call to measure the mapping
 * with". */
int shardd__cudart_ipc_open(const void *handle, int dev, void **out,
                            size_t *avail, const char **what) {
  cuda_ipc_handle h;
  memcpy(&h, handle, sizeof h);
  int cur = -1;
  *what = "cudaGetDevice";
  int e = cudart.get_device(&cur);
  if (e == 0 && cur != dev) {
    *what = "cudaSetDevice";
    e = cudart.set_device(dev);
  }
  if (e == 0) {
    *what = "cudaIpcOpenMemHandle";
    e = cudart.ipc_open(out, h, CUDA_IPC_LAZY_PEER);
  }
  if (e == 0) {
    pthread_once(&cudrv.once, cudrv_load);
    *what = shardd__cudart_range_call;
    unsigned long long base = 0, p = (unsigned long long)(uintptr_t)*out;
    size_t size = 0;
    e = cudrv.get_range ? cudrv.get_range(&base, &size, p) : -1;
    if (e == 0 && (p < base || p - base > size))
      e = -2; /* not an address inside the range it reported */
    if (e == 0)
      *avail = size - (size_t)(p - base);
    else
      (void)cudart.ipc_close(*out);
  }
  if (cur >= 0 && cur != dev)
    (void)cudart.set_device(cur);
  return e;
}

const char *shardd__cudart_why(void) { return cudart.why; }

void shardd__cudart_ipc_close(void *base, int device) {
  int cur = -1;
  if (cudart.get_device(&cur) == 0 && cur != device)
    (void)cudart.set_device(device);
  (void)cudart.ipc_close(base);
  if (cur >= 0 && cur != device)
    (void)cudart.set_device(cur);
}
