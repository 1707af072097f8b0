// Endpoint: a UCX endpoint to a peer's worker, made by Agent.connect.
#pragma once

#include <napi.h>

#include <cstdint>
#include <memory>

#include "handle.h"
#include "progress.h"
#include "wire.h"

namespace kvxfer {

class EndpointWrap : public Napi::ObjectWrap<EndpointWrap>, public Child {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit EndpointWrap(const Napi::CallbackInfo& info);
  ~EndpointWrap() override { Release(); }
  void CloseFromParent(bool) override { Release(); }

  std::shared_ptr<EndpointCore> core_;
  HandleState state_ = HandleState::kOpen;
  uint64_t inflight_ = 0;
  void OpDone();

 private:
  Napi::Value Id(const Napi::CallbackInfo& info);
  Napi::Value State(const Napi::CallbackInfo& info);
  Napi::Value ImportRemote(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);
  Napi::Value Abandon(const Napi::CallbackInfo& info);
  Napi::Value Settle(const Napi::CallbackInfo& info);
  static void PopulateMapped(ucp_rkey_h rkey, const RemoteBlob& blob);
  void Release();
};

}  // namespace kvxfer
