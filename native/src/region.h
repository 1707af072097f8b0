// Region: local memory registered with UCX (a JavaScript buffer, a mapped
// file, or memory UCX allocated), the source or target of transfers.
#pragma once

#include <napi.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "handle.h"
#include "memory_type.h"

namespace kvxfer {

// Faults in every page of [addr, addr + length) for writing (MADV_POPULATE_WRITE), so that no
// transfer takes those page faults. Best effort: a kernel without it (before 5.14) leaves them
// to the first writes.
void PopulateWrite(void* addr, size_t length);

// A file mapping (munmap) or an attached SysV segment (shmdt), released with the last holder.
struct Mapping {
  void* addr = nullptr;
  size_t length = 0;
  bool segment = false;
  Mapping(void* a, size_t n, bool seg = false) : addr(a), length(n), segment(seg) {}
  ~Mapping() {
    if (addr == nullptr) return;
    if (segment) {
      shmdt(addr);
    } else {
      munmap(addr, length);
    }
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

class RegionWrap : public Napi::ObjectWrap<RegionWrap>, public Child {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit RegionWrap(const Napi::CallbackInfo& info);
  ~RegionWrap() override { Release(false); }
  void CloseFromParent(bool js) override { Release(js); }

  uint8_t* base() const { return base_; }
  ucp_mem_h memh() const { return memh_; }
  uint64_t length() const { return length_; }
  HandleState state_ = HandleState::kOpen;
  uint64_t inflight_ = 0;
  void OpDone();

  // Set by the agent right after construction.
  void InitBuffer(Napi::Env env, Napi::Value owner, uint8_t* base, size_t length, ucp_mem_h memh);
  void InitAllocated(uint8_t* base, size_t length, ucp_mem_h memh, int segment) {
    base_ = base;
    length_ = length;
    memh_ = memh;
    allocated_ = true;
    segment_ = segment;
  }
  void InitFile(void* map, size_t map_length, uint8_t* base, size_t length, ucp_mem_h memh,
                std::string path);
  // An attached SysV segment (Agent.attachSegment): detached with the last holder.
  void InitSegment(void* addr, size_t length, ucp_mem_h memh, int shmid);
  // Memory at an address the caller owns (Agent.registerAddress): CUDA device memory, CUDA
  // host-pinned memory, or host memory mapped by someone else. Only unregistered at close.
  void InitAddress(uint8_t* base, size_t length, ucp_mem_h memh, MemKind kind, int device) {
    base_ = base;
    length_ = length;
    memh_ = memh;
    kind_ = kind;
    device_ = device;
  }
  MemKind kind() const { return kind_; }
  // CUDA memory the region's bytes live in (an opened IPC mapping, or an allocation), released
  // after the region is unregistered.
  void HoldDeviceMemory(std::shared_ptr<void> mem) { device_memory_ = std::move(mem); }

 private:
  Napi::Value Address(const Napi::CallbackInfo& info);
  Napi::Value Length(const Napi::CallbackInfo& info);
  Napi::Value Path(const Napi::CallbackInfo& info);
  Napi::Value Segment(const Napi::CallbackInfo& info);
  Napi::Value MemoryType(const Napi::CallbackInfo& info);
  Napi::Value Device(const Napi::CallbackInfo& info);
  Napi::Value RemoteKey(const Napi::CallbackInfo& info);
  Napi::Value View(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);
  Napi::Value IsClosed(const Napi::CallbackInfo& info);
  void Release(bool js);

  uint8_t* base_ = nullptr;
  uint64_t length_ = 0;
  ucp_mem_h memh_ = nullptr;
  Napi::ObjectReference owner_;  // keeps a registered Buffer alive
  // A mapped file stays mapped while any JavaScript view of it may still be
  // reachable: each view holds a reference, released by its finalizer.
  std::shared_ptr<Mapping> mapping_;
  std::shared_ptr<void> device_memory_;
  bool allocated_ = false;
  std::string path_;
  // The SysV shared-memory id of the region's memory (allocated by UCX from its sysv memory
  // domain, or attached), or -1.
  int segment_ = -1;
  MemKind kind_ = MemKind::kHost;
  int device_ = -1;  // the CUDA device of a cuda or cuda-host region, or -1
  std::vector<Napi::Reference<Napi::ArrayBuffer>> views_;
};

}  // namespace kvxfer
