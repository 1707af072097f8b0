#include "region.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "progress.h"
#include "wire.h"

namespace kvxfer {

void PopulateWrite(void* addr, size_t length) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t start = lo - lo % page;
#ifdef MADV_POPULATE_WRITE
  madvise(reinterpret_cast<void*>(start), lo + length - start, MADV_POPULATE_WRITE);
#else
  (void)start;
#endif
}

Napi::Function RegionWrap::Define(Napi::Env env) {
  return DefineClass(env, "Region",
                     {
                         InstanceAccessor<&RegionWrap::Address>("address"),
                         InstanceAccessor<&RegionWrap::Length>("length"),
                         InstanceAccessor<&RegionWrap::Path>("path"),
                         InstanceAccessor<&RegionWrap::Segment>("segment"),
                         InstanceAccessor<&RegionWrap::MemoryType>("memoryType"),
                         InstanceAccessor<&RegionWrap::Device>("device"),
                         InstanceAccessor<&RegionWrap::IsClosed>("closed"),
                         InstanceMethod<&RegionWrap::RemoteKey>("remoteKey"),
                         InstanceMethod<&RegionWrap::View>("view"),
                         InstanceMethod<&RegionWrap::Close>("close"),
                     });
}

RegionWrap::RegionWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<RegionWrap>(info) {
  if (!IsInternalCall(info)) {
    throw MakeError(info.Env(), "ERR_INVALID_ARGUMENT",
                    "Region handles come from Agent.registerMemory or Agent.mapFile");
  }
  TagObject(info.Env(), info.This().As<Napi::Object>(), kRegionTag);
}

void RegionWrap::InitBuffer(Napi::Env env, Napi::Value owner, uint8_t* base, size_t length,
                            ucp_mem_h memh) {
  base_ = base;
  length_ = length;
  memh_ = memh;
  owner_ = Napi::Persistent(owner.As<Napi::Object>());
}

void RegionWrap::InitFile(void* map, size_t map_length, uint8_t* base, size_t length,
                          ucp_mem_h memh, std::string path) {
  mapping_ = std::make_shared<Mapping>(map, map_length);
  base_ = base;
  length_ = length;
  memh_ = memh;
  path_ = std::move(path);
}

void RegionWrap::InitSegment(void* addr, size_t length, ucp_mem_h memh, int shmid) {
  mapping_ = std::make_shared<Mapping>(addr, length, true);
  base_ = static_cast<uint8_t*>(addr);
  length_ = length;
  memh_ = memh;
  segment_ = shmid;
}

void RegionWrap::OpDone() {
  inflight_--;
  if (inflight_ == 0 && state_ == HandleState::kClosing) Release(true);
}

void RegionWrap::Release(bool js) {
  if (state_ == HandleState::kClosed) return;
  state_ = HandleState::kClosed;
  // Views are detached when JavaScript can be touched; otherwise (finalizer,
  // exit) they are left alone and keep a mapped file mapped through their own
  // reference, so no view ever points at unmapped memory.
  const bool views_left = !js && !views_.empty();
  if (js) {
    for (auto& ref : views_) {
      if (!ref.IsEmpty()) {
        Napi::ArrayBuffer ab = ref.Value();
        if (!ab.IsEmpty() && !ab.IsDetached()) ab.Detach();
      }
    }
  }
  views_.clear();
  // UCX-allocated memory with views that may live on is left allocated (this
  // only happens at exit or when everything was dropped without close()).
  if (memh_ && agent_ && agent_->engine() && !(allocated_ && views_left)) {
    ucp_mem_unmap(agent_->engine()->context(), memh_);
  }
  memh_ = nullptr;
  mapping_.reset();
  device_memory_.reset();
  owner_.Reset();
  if (agent_) agent_->Forget(this);
  agent_ = nullptr;
}

Napi::Value RegionWrap::Address(const Napi::CallbackInfo& info) {
  return Napi::BigInt::New(info.Env(), static_cast<uint64_t>(reinterpret_cast<uintptr_t>(base_)));
}
Napi::Value RegionWrap::Length(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(length_));
}
Napi::Value RegionWrap::Path(const Napi::CallbackInfo& info) {
  if (path_.empty()) return info.Env().Null();
  return Napi::String::New(info.Env(), path_);
}
Napi::Value RegionWrap::Segment(const Napi::CallbackInfo& info) {
  if (segment_ < 0) return info.Env().Null();
  return Napi::Number::New(info.Env(), segment_);
}
Napi::Value RegionWrap::MemoryType(const Napi::CallbackInfo& info) {
  return Napi::String::New(info.Env(), MemKindName(kind_));
}
Napi::Value RegionWrap::Device(const Napi::CallbackInfo& info) {
  if (device_ < 0) return info.Env().Null();
  return Napi::Number::New(info.Env(), device_);
}
Napi::Value RegionWrap::IsClosed(const Napi::CallbackInfo& info) {
  return Napi::Boolean::New(info.Env(), state_ != HandleState::kOpen);
}

Napi::Value RegionWrap::RemoteKey(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (state_ != HandleState::kOpen || !agent_)
    throw MakeError(env, "ERR_CLOSED", "remoteKey: the region is closed");
  void* buf = nullptr;
  size_t size = 0;
  ucs_status_t status = ucp_rkey_pack(agent_->engine()->context(), memh_, &buf, &size);
  if (status != UCS_OK) throw UcsError(env, "ucp_rkey_pack failed", status);
  std::vector<uint8_t> blob =
      WrapRemote(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(base_)), length_, buf, size);
  ucp_rkey_buffer_release(buf);
  return Napi::Buffer<uint8_t>::Copy(env, blob.data(), blob.size());
}

// view(): an ArrayBuffer over the region's memory, detached when the region closes.
Napi::Value RegionWrap::View(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", "view: the region is closed");
  if (kind_ == MemKind::kCuda) {
    throw MakeError(env, "ERR_MEMORY_TYPE",
                    "view: the region is CUDA device memory, which the CPU cannot read; copy it to "
                    "host memory first");
  }
  if (!owner_.IsEmpty()) return owner_.Value();
  Napi::ArrayBuffer ab;
  if (mapping_) {
    auto* hold = new std::shared_ptr<Mapping>(mapping_);
    ab = Napi::ArrayBuffer::New(
        env, base_, length_, [](Napi::Env, void*, std::shared_ptr<Mapping>* h) { delete h; }, hold);
  } else {
    ab = Napi::ArrayBuffer::New(env, base_, length_);
  }
  views_.push_back(Napi::Persistent(ab));
  return ab;
}

Napi::Value RegionWrap::Close(const Napi::CallbackInfo& info) {
  if (state_ == HandleState::kOpen) {
    state_ = HandleState::kClosing;
    if (inflight_ == 0) Release(true);
  }
  return info.Env().Undefined();
}

}  // namespace kvxfer
