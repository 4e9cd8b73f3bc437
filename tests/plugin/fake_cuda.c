/* A stand-in libcuda.so.1 for CPU-only tests of the plugin's GPU UUID lookup: device 3,
 * UUID bytes 0x10..0x1f. Loaded by the plugin with dlopen() when it is on LD_LIBRARY_PATH. */
#define NW_FAKE_EXPORT __attribute__((visibility("default")))

NW_FAKE_EXPORT int cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }

NW_FAKE_EXPORT int cuCtxGetDevice(int* device) {
  *device = 3;
  return 0;
}

NW_FAKE_EXPORT int cuDeviceGetUuid_v2(unsigned char uuid[16], int device) {
  if (device != 3) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0x10 + i);
  return 0;
}
