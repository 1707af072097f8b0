// The CUDA driver API, loaded at run time: the addon links no CUDA library, so one build runs on
// hosts with and without a GPU. libcuda.so.1 (or the file KVXFER_LIBCUDA names: tests load a stub
// there) is opened on first use and stays loaded; without it every call here refuses, naming the
// library and dlerror().
//
// What the sidecar needs from CUDA is small: open another process's memory from its IPC handle
// (the vLLM worker owns the KV tensors; docs/gpu.md has the process model), check what it
// opened, allocate device memory of its own (the device check's reference and the fallback where
// imported memory cannot be re-exported), and close each again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kvxfer {
namespace cuda {

// A CUDA IPC memory handle (CUipcMemHandle / cudaIpcMemHandle_t) is 64 opaque bytes.
constexpr size_t kIpcHandleBytes = 64;

// Why a call failed: `code` is "ERR_CUDA_UNAVAILABLE" (no driver, no such device) or "ERR_CUDA"
// (a driver call failed), `message` names the call and the driver's error name.
struct Failure {
  std::string code;
  std::string message;
};

// Device memory this process reaches at `ptr`: opened from an IPC handle (closed with
// cuIpcCloseMemHandle) or allocated here (cuMemFree), released when the last holder goes.
class DeviceMemory {
 public:
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // The address of the allocation's first byte in this process, and its size.
  uint64_t base() const { return base_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  bool imported() const { return imported_; }

  // Opens `handle` (kIpcHandleBytes) on `device`; `need` bytes at `offset` must lie inside the
  // allocation the handle names. nullptr and `*why` filled on failure (nothing stays open). A
  // handle this process already holds open is shared, not opened again: the driver maps one
  // allocation once per process (two KV tensors may live in one cudaMalloc segment).
  static std::shared_ptr<DeviceMemory> OpenIpc(const uint8_t* handle, int device, uint64_t offset,
                                               uint64_t need, Failure* why);
  // Allocates `size` bytes on `device`. nullptr and `*why` filled on failure.
  static std::shared_ptr<DeviceMemory> Allocate(size_t size, int device, Failure* why);

 private:
  DeviceMemory(uint64_t base, size_t size, int device, bool imported)
      : base_(base), size_(size), device_(device), imported_(imported) {}
  uint64_t base_;
  size_t size_;
  int device_;
  bool imported_;
  std::string key_;  // the IPC handle's key among the process's open mappings
};

// "" when the driver loads and has at least one device; otherwise why not (for messages).
std::string Unavailable();

// Makes `device`'s primary context current on the calling thread, unless a context is current
// there already. The agent runs it on its progress thread once it holds CUDA memory: UCX's
// cuda_ipc asks the thread's current context which device it is on when it unpacks a peer's key,
// and finds no path without one.
bool AdoptDevice(int device, Failure* why);

}  // namespace cuda
}  // namespace kvxfer
