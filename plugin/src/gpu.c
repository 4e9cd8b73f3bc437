/* The current GPU's UUID, from the CUDA driver loaded at run time.
 *
 * The plugin links against neither CUDA nor NCCL: libcuda.so.1 is dlopen()ed on first use
 * and everything falls back to "unknown" when it, a symbol or a call is missing (CPU-only
 * CI, containers without the driver). NCCL calls init with the communicator's device
 * current, so the current context's device is the communicator's GPU.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "nw.h"

typedef int (*nw_cu_init_fn)(unsigned int);
typedef int (*nw_cu_ctx_get_device_fn)(int*);
typedef int (*nw_cu_device_get_uuid_fn)(unsigned char uuid[16], int dev);

void nw_gpu_current(char gpu[NW_GPU_MAX], char bare[NW_GPU_MAX], int* ordinal) {
  snprintf(gpu, NW_GPU_MAX, "unknown");
  snprintf(bare, NW_GPU_MAX, "unknown");
  *ordinal = -1;
  /* Kept open for the life of the process: libcuda is already loaded by NCCL anyway. */
  static void* lib;
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return;
  nw_cu_init_fn cu_init = (nw_cu_init_fn)(uintptr_t)dlsym(lib, "cuInit");
  nw_cu_ctx_get_device_fn get_dev = (nw_cu_ctx_get_device_fn)(uintptr_t)dlsym(lib, "cuCtxGetDevice");
  nw_cu_device_get_uuid_fn get_uuid =
      (nw_cu_device_get_uuid_fn)(uintptr_t)dlsym(lib, "cuDeviceGetUuid_v2");
  if (!get_uuid) get_uuid = (nw_cu_device_get_uuid_fn)(uintptr_t)dlsym(lib, "cuDeviceGetUuid");
  if (!cu_init || !get_dev || !get_uuid || cu_init(0) != 0) return;
  int dev = -1;
  if (get_dev(&dev) != 0 || dev < 0) return;
  unsigned char u[16];
  if (get_uuid(u, dev) != 0) return;
  *ordinal = dev;
  snprintf(bare, NW_GPU_MAX,
           "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
           u[15]);
  snprintf(gpu, NW_GPU_MAX, "GPU-%s", bare);
}
