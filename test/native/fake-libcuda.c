/*
 * A stand-in for libcuda.so.1 at the CUDA boundary, for test/native/cuda-stub.test.ts: the addon
 * loads it through KVXFER_LIBCUDA and cannot tell it from a driver. "Device memory" is host
 * memory from malloc; every open, close, allocation and free is appended to $FAKE_CUDA_LOG, so a
 * test sees what the addon left open.
 *
 * An IPC handle here is: bytes 0..7 the allocation's size (little-endian), byte 8 its device
 * ordinal, byte 9 nonzero to make cuIpcOpenMemHandle fail with CUDA_ERROR_INVALID_VALUE, byte 10
 * nonzero to make the memory look like host memory (CU_MEMORYTYPE_HOST).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long CUdeviceptr;
typedef struct {
  char reserved[64];
} CUipcMemHandle;

#define MAX_ALLOCS 64
static struct {
  CUdeviceptr base;
  size_t size;
  int device;
  unsigned type;
} allocs[MAX_ALLOCS];

static void note(const char* what, CUdeviceptr p, size_t n) {
  const char* path = getenv("FAKE_CUDA_LOG");
  if (path == NULL) return;
  FILE* f = fopen(path, "a");
  if (f == NULL) return;
  fprintf(f, "%s %llx %zu\n", what, p, n);
  fclose(f);
}

static int track(CUdeviceptr base, size_t size, int device, unsigned type) {
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    if (allocs[i].base == 0) {
      allocs[i].base = base;
      allocs[i].size = size;
      allocs[i].device = device;
      allocs[i].type = type;
      return 0;
    }
  }
  return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
}

static int find(CUdeviceptr p) {
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    if (allocs[i].base != 0 && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) return i;
  }
  return -1;
}

int cuInit(unsigned flags) { return getenv("FAKE_CUDA_NO_DEVICE") != NULL ? 100 : 0; }
int cuDriverGetVersion(int* v) {
  *v = 13000;
  return 0;
}
int cuDeviceGetCount(int* n) {
  *n = 1;
  return 0;
}
int cuDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return 0;
}
static int ctx_token;
int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  *ctx = &ctx_token;
  return 0;
}
int cuCtxSetCurrent(void* ctx) { return ctx == &ctx_token ? 0 : 201; /* INVALID_CONTEXT */ }

int cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  uint64_t size = 0;
  memcpy(&size, h.reserved, 8);
  if (h.reserved[9] != 0 || size == 0) return 1; /* CUDA_ERROR_INVALID_VALUE */
  void* p = malloc(size);
  if (p == NULL) return 2;
  *out = (CUdeviceptr)(uintptr_t)p;
  track(*out, size, h.reserved[8], h.reserved[10] != 0 ? 1u : 2u);
  note("open", *out, size);
  return 0;
}

int cuIpcCloseMemHandle(CUdeviceptr p) {
  int i = find(p);
  if (i < 0 || allocs[i].base != p) return 1;
  note("close", p, allocs[i].size);
  allocs[i].base = 0;
  free((void*)(uintptr_t)p);
  return 0;
}

int cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  int i = find(p);
  if (i < 0) return 1;
  *base = allocs[i].base;
  *size = allocs[i].size;
  return 0;
}

int cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
  int i = find(p);
  if (i < 0) return 1;
  if (attr == 2) {
    *(unsigned*)data = allocs[i].type;
  } else if (attr == 9) {
    *(int*)data = allocs[i].device;
  } else {
    return 1;
  }
  return 0;
}

int cuMemAlloc_v2(CUdeviceptr* out, size_t size) {
  void* p = malloc(size);
  if (p == NULL) return 2;
  *out = (CUdeviceptr)(uintptr_t)p;
  track(*out, size, 0, 2u);
  note("alloc", *out, size);
  return 0;
}

int cuMemFree_v2(CUdeviceptr p) {
  int i = find(p);
  if (i < 0 || allocs[i].base != p) return 1;
  note("free", p, allocs[i].size);
  allocs[i].base = 0;
  free((void*)(uintptr_t)p);
  return 0;
}

int cuGetErrorName(int r, const char** name) {
  switch (r) {
    case 1:
      *name = "CUDA_ERROR_INVALID_VALUE";
      return 0;
    case 2:
      *name = "CUDA_ERROR_OUT_OF_MEMORY";
      return 0;
    case 100:
      *name = "CUDA_ERROR_NO_DEVICE";
      return 0;
    default:
      return 1;
  }
}

int cuCtxGetCurrent(void** ctx) {
  *ctx = NULL;
  return 0;
}
