// RemoteRegion: a peer's region, imported from its remote key on one endpoint.
#pragma once

#include <napi.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>

#include "handle.h"
#include "progress.h"

namespace kvxfer {

class RemoteWrap : public Napi::ObjectWrap<RemoteWrap>, public Child {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit RemoteWrap(const Napi::CallbackInfo& info);
  ~RemoteWrap() override { Release(); }
  void CloseFromParent(bool) override { Release(); }

  std::shared_ptr<EndpointCore> ep_;
  ucp_rkey_h rkey_ = nullptr;
  uint64_t address_ = 0;
  uint64_t length_ = 0;
  HandleState state_ = HandleState::kOpen;
  uint64_t inflight_ = 0;
  void OpDone();

 private:
  Napi::Value Length(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);
  void Release();
};

}  // namespace kvxfer
