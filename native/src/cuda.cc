#include "cuda.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace kvxfer {
namespace cuda {

namespace {

// The few driver API types used here, as cuda.h declares them (no CUDA headers at build time).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): cuda.h's own type
struct CUipcMemHandle {
  char reserved[kIpcHandleBytes];
};
constexpr CUresult kSuccess = 0;
constexpr unsigned kIpcLazyEnablePeerAccess = 1;   // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr int kPointerAttributeMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;          // CU_MEMORYTYPE_DEVICE

struct Driver {
  void* lib = nullptr;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned) = nullptr;
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr) = nullptr;
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  int devices = 0;
  std::string unavailable;  // why the driver cannot be used, or ""
  std::mutex mu;
  std::unordered_map<int, CUcontext> contexts;  // retained primary contexts, kept for the process
  // Open IPC mappings by (device, handle bytes): one per allocation and process.
  std::unordered_map<std::string, std::weak_ptr<DeviceMemory>> opened;
};

// cuda.h maps several names to versioned symbols (cuIpcOpenMemHandle -> _v2 since CUDA 11): take
// the versioned one where the driver has it.
template <typename F>
bool Bind(void* lib, F* fn, const char* name, const char* versioned = nullptr) {
  void* sym = versioned != nullptr ? dlsym(lib, versioned) : nullptr;
  if (sym == nullptr) sym = dlsym(lib, name);
  *fn = reinterpret_cast<F>(sym);
  return sym != nullptr;
}

Driver& Load() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("KVXFER_LIBCUDA");
    const std::string path = env != nullptr && *env != '\0' ? env : "libcuda.so.1";
    d.lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (d.lib == nullptr) {
      const char* err = dlerror();
      d.unavailable = "the CUDA driver library " + path + " cannot be loaded (" +
                      (err != nullptr ? err : "unknown dlopen error") +
                      "): this host has no CUDA driver, or it is not on the loader's path";
      return;
    }
    bool ok = true;
    ok &= Bind(d.lib, &d.cuInit, "cuInit");
    ok &= Bind(d.lib, &d.cuDriverGetVersion, "cuDriverGetVersion");
    ok &= Bind(d.lib, &d.cuDeviceGetCount, "cuDeviceGetCount");
    ok &= Bind(d.lib, &d.cuDeviceGet, "cuDeviceGet");
    ok &= Bind(d.lib, &d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    ok &= Bind(d.lib, &d.cuCtxSetCurrent, "cuCtxSetCurrent");
    ok &= Bind(d.lib, &d.cuCtxGetCurrent, "cuCtxGetCurrent");
    ok &= Bind(d.lib, &d.cuIpcOpenMemHandle, "cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2");
    ok &= Bind(d.lib, &d.cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    ok &= Bind(d.lib, &d.cuMemGetAddressRange, "cuMemGetAddressRange", "cuMemGetAddressRange_v2");
    ok &= Bind(d.lib, &d.cuPointerGetAttribute, "cuPointerGetAttribute");
    ok &= Bind(d.lib, &d.cuMemAlloc, "cuMemAlloc", "cuMemAlloc_v2");
    ok &= Bind(d.lib, &d.cuMemFree, "cuMemFree", "cuMemFree_v2");
    Bind(d.lib, &d.cuGetErrorName, "cuGetErrorName");
    if (!ok) {
      d.unavailable = path + " lacks a driver API function kvxfer needs (CUDA >= 11 required)";
      return;
    }
    CUresult r = d.cuInit(0);
    if (r == kSuccess) r = d.cuDeviceGetCount(&d.devices);
    if (r != kSuccess) {
      const char* name = nullptr;
      if (d.cuGetErrorName != nullptr) d.cuGetErrorName(r, &name);
      d.unavailable = "cuInit failed on " + path + " (" +
                      (name != nullptr ? name : "CUresult " + std::to_string(r)) +
                      "): the driver found no usable GPU";
      return;
    }
    if (d.devices == 0) d.unavailable = "the CUDA driver (" + path + ") reports no GPU";
  });
  return d;
}

std::string ErrorName(Driver& d, CUresult r) {
  const char* name = nullptr;
  if (d.cuGetErrorName != nullptr && d.cuGetErrorName(r, &name) == kSuccess && name != nullptr) {
    return name;
  }
  return "CUresult " + std::to_string(r);
}

bool Fail(Failure* why, const char* code, std::string message) {
  why->code = code;
  why->message = std::move(message);
  return false;
}

// Makes `device`'s primary context current on this thread (retained once per process).
bool UseDevice(Driver& d, int device, Failure* why) {
  if (!d.unavailable.empty()) return Fail(why, "ERR_CUDA_UNAVAILABLE", d.unavailable);
  if (device < 0 || device >= d.devices) {
    return Fail(why, "ERR_CUDA_UNAVAILABLE",
                "CUDA device " + std::to_string(device) + " does not exist (the driver sees " +
                    std::to_string(d.devices) + ")");
  }
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.contexts.find(device);
    if (it != d.contexts.end()) {
      ctx = it->second;
    } else {
      CUdevice dev = 0;
      CUresult r = d.cuDeviceGet(&dev, device);
      if (r == kSuccess) r = d.cuDevicePrimaryCtxRetain(&ctx, dev);
      if (r != kSuccess) {
        return Fail(why, "ERR_CUDA",
                    "cuDevicePrimaryCtxRetain(device " + std::to_string(device) +
                        ") failed: " + ErrorName(d, r));
      }
      d.contexts[device] = ctx;
    }
  }
  CUresult r = d.cuCtxSetCurrent(ctx);
  if (r != kSuccess) return Fail(why, "ERR_CUDA", "cuCtxSetCurrent failed: " + ErrorName(d, r));
  return true;
}

std::string IpcKey(const uint8_t* handle, int device) {
  return std::to_string(device) + ":" +
         std::string(reinterpret_cast<const char*>(handle), kIpcHandleBytes);
}

}  // namespace

std::string Unavailable() { return Load().unavailable; }

bool AdoptDevice(int device, Failure* why) {
  Driver& d = Load();
  if (!d.unavailable.empty()) return Fail(why, "ERR_CUDA_UNAVAILABLE", d.unavailable);
  CUcontext current = nullptr;
  if (d.cuCtxGetCurrent(&current) == kSuccess && current != nullptr) return true;
  return UseDevice(d, device, why);
}

DeviceMemory::~DeviceMemory() {
  Driver& d = Load();
  Failure ignored;
  // The driver calls need the device's context on the releasing thread (the JavaScript thread,
  // or whichever thread drops the last holder).
  if (!UseDevice(d, device_, &ignored)) return;
  if (imported_) {
    {
      std::lock_guard<std::mutex> lock(d.mu);
      auto it = d.opened.find(key_);
      if (it != d.opened.end() && it->second.expired()) d.opened.erase(it);
    }
    d.cuIpcCloseMemHandle(static_cast<CUdeviceptr>(base_));
  } else {
    d.cuMemFree(static_cast<CUdeviceptr>(base_));
  }
}

std::shared_ptr<DeviceMemory> DeviceMemory::OpenIpc(const uint8_t* handle, int device,
                                                    uint64_t offset, uint64_t need, Failure* why) {
  Driver& d = Load();
  if (!UseDevice(d, device, why)) return nullptr;
  const std::string key = IpcKey(handle, device);
  std::shared_ptr<DeviceMemory> held;  // outside the lock: its destructor may take it
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.opened.find(key);
    if (it != d.opened.end()) held = it->second.lock();
  }
  if (held) {
    if (offset > held->size_ || need > held->size_ - offset) {
      Fail(why, "ERR_OUT_OF_BOUNDS",
           std::to_string(need) + " bytes at offset " + std::to_string(offset) +
               " do not fit the allocation the handle names (" + std::to_string(held->size_) +
               " bytes)");
      return nullptr;
    }
    return held;
  }
  CUipcMemHandle h;
  std::memcpy(h.reserved, handle, kIpcHandleBytes);
  CUdeviceptr ptr = 0;
  CUresult r = d.cuIpcOpenMemHandle(&ptr, h, kIpcLazyEnablePeerAccess);
  if (r != kSuccess) {
    Fail(why, "ERR_CUDA",
         "cuIpcOpenMemHandle failed: " + ErrorName(d, r) +
             " (the handle must come from cudaIpcGetMemHandle in another live process on this "
             "host, for memory on device " +
             std::to_string(device) + ")");
    return nullptr;
  }
  // Owned from here: every refusal below closes the mapping again.
  std::shared_ptr<DeviceMemory> mem(new DeviceMemory(ptr, 0, device, true));
  CUdeviceptr base = 0;
  size_t size = 0;
  r = d.cuMemGetAddressRange(&base, &size, ptr);
  if (r != kSuccess) {
    Fail(why, "ERR_CUDA", "cuMemGetAddressRange on the opened handle failed: " + ErrorName(d, r));
    return nullptr;
  }
  unsigned mem_type = 0;
  int ordinal = -1;
  r = d.cuPointerGetAttribute(&mem_type, kPointerAttributeMemoryType, ptr);
  if (r == kSuccess) r = d.cuPointerGetAttribute(&ordinal, kPointerAttributeDeviceOrdinal, ptr);
  if (r != kSuccess) {
    Fail(why, "ERR_CUDA", "cuPointerGetAttribute on the opened handle failed: " + ErrorName(d, r));
    return nullptr;
  }
  if (mem_type != kMemoryTypeDevice) {
    Fail(why, "ERR_CUDA",
         "the IPC handle opened memory of CUDA memory type " + std::to_string(mem_type) +
             ", not device memory");
    return nullptr;
  }
  if (ordinal != device) {
    Fail(why, "ERR_CUDA",
         "the IPC handle names memory on CUDA device " + std::to_string(ordinal) + ", not device " +
             std::to_string(device) +
             " (device indices differ between processes when CUDA_VISIBLE_DEVICES differs)");
    return nullptr;
  }
  mem->size_ = size;
  if (base != ptr || offset > size || need > size - offset) {
    Fail(why, "ERR_OUT_OF_BOUNDS",
         std::to_string(need) + " bytes at offset " + std::to_string(offset) +
             " do not fit the allocation the handle names (" + std::to_string(size) + " bytes)");
    return nullptr;
  }
  mem->key_ = key;
  std::lock_guard<std::mutex> lock(d.mu);
  d.opened[key] = mem;
  return mem;
}

std::shared_ptr<DeviceMemory> DeviceMemory::Allocate(size_t size, int device, Failure* why) {
  Driver& d = Load();
  if (!UseDevice(d, device, why)) return nullptr;
  CUdeviceptr ptr = 0;
  CUresult r = d.cuMemAlloc(&ptr, size);
  if (r != kSuccess) {
    Fail(why, "ERR_CUDA",
         "cuMemAlloc(" + std::to_string(size) + " bytes, device " + std::to_string(device) +
             ") failed: " + ErrorName(d, r));
    return nullptr;
  }
  return std::shared_ptr<DeviceMemory>(new DeviceMemory(ptr, size, device, false));
}

}  // namespace cuda
}  // namespace kvxfer
