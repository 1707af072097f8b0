// The agent's CUDA methods: device memory opened from another process's IPC handle, or allocated
// here, registered with UCX as CUDA memory. Apart from agent.cc so that hosts and builds without
// CUDA see none of it: the driver is loaded at run time (cuda.h).
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "agent.h"
#include "cuda.h"
#include "region.h"
#include "wire.h"

namespace kvxfer {

namespace {

// A non-negative integer below 2^53 from a JavaScript number, or false.
bool WholeNumber(const Napi::Value& v, uint64_t* out) {
  if (!v.IsNumber()) return false;
  double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= 0) || std::floor(d) != d || d > 9007199254740992.0) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

}  // namespace

Napi::Object AgentWrap::CudaRegion(Napi::Env env, const char* what,
                                   std::shared_ptr<cuda::DeviceMemory> mem, uint64_t offset,
                                   uint64_t length) {
  // UCX refuses by name what it cannot serve; the memory opened above closes with `mem`.
  const std::string refusal = RefusalFor(MemKind::kCuda, engine_->context_info());
  if (!refusal.empty()) {
    throw MakeError(env, "ERR_MEMORY_TYPE_UNSUPPORTED",
                    std::string(what) + ": cannot register " + refusal);
  }
  auto* base = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(mem->base() + offset));
  ucp_mem_h memh = nullptr;
  ucs_status_t status = RegisterRange(base, length, &memh, MemKind::kCuda);
  if (status != UCS_OK) {
    throw UcsError(env, std::string(what) + ": ucp_mem_map failed for cuda memory", status);
  }
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  // The progress thread gets the device's context (unless it has one): UCX's cuda_ipc asks it.
  const int device = mem->device();
  engine_->RunAsync([device]() {
    cuda::Failure ignored;
    cuda::AdoptDevice(device, &ignored);
  });
  region->InitAddress(base, length, memh, MemKind::kCuda, device);
  region->HoldDeviceMemory(std::move(mem));
  return obj;
}

// openCudaIpc(handle: 64 bytes, device, offset, length): `length` bytes at `offset` of the
// allocation another process exported with cudaIpcGetMemHandle, opened in this process on CUDA
// device `device` and registered as CUDA memory. Closing the region closes the mapping.
Napi::Value AgentWrap::OpenCudaIpc(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "openCudaIpc");
  const uint8_t* handle = nullptr;
  size_t handle_len = 0;
  if (info.Length() < 4 || !BytesOf(info[0], &handle, &handle_len) || !info[1].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "openCudaIpc(handle: Uint8Array(64), device: number, offset: number, length: "
                    "number)");
  }
  if (handle_len != cuda::kIpcHandleBytes) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "openCudaIpc: a CUDA IPC handle is " + std::to_string(cuda::kIpcHandleBytes) +
                        " bytes, got " + std::to_string(handle_len));
  }
  const int device = info[1].As<Napi::Number>().Int32Value();
  uint64_t offset = 0;
  uint64_t length = 0;
  if (!WholeNumber(info[2], &offset) || !WholeNumber(info[3], &length) || length == 0) {
    throw MakeError(env, "ERR_INVALID_LENGTH",
                    "openCudaIpc: offset must be a non-negative integer and length a positive one",
                    UCS_OK, true);
  }
  cuda::Failure why;
  std::shared_ptr<cuda::DeviceMemory> mem =
      cuda::DeviceMemory::OpenIpc(handle, device, offset, length, &why);
  if (!mem) throw MakeError(env, why.code, "openCudaIpc: " + why.message);
  return CudaRegion(env, "openCudaIpc", std::move(mem), offset, length);
}

// allocateCuda(length, device): device memory this process allocates (cuMemAlloc) and frees
// when the region closes.
Napi::Value AgentWrap::AllocateCuda(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "allocateCuda");
  uint64_t length = 0;
  if (info.Length() < 2 || !info[1].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT", "allocateCuda(length: number, device: number)");
  }
  if (!WholeNumber(info[0], &length) || length == 0) {
    throw MakeError(env, "ERR_INVALID_LENGTH", "allocateCuda: length must be a positive integer",
                    UCS_OK, true);
  }
  cuda::Failure why;
  std::shared_ptr<cuda::DeviceMemory> mem = cuda::DeviceMemory::Allocate(
      static_cast<size_t>(length), info[1].As<Napi::Number>().Int32Value(), &why);
  if (!mem) throw MakeError(env, why.code, "allocateCuda: " + why.message);
  return CudaRegion(env, "allocateCuda", std::move(mem), 0, length);
}

}  // namespace kvxfer
