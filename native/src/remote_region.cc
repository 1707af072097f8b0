#include "remote_region.h"

#include "wire.h"

namespace kvxfer {

Napi::Function RemoteWrap::Define(Napi::Env env) {
  return DefineClass(env, "RemoteRegion",
                     {
                         InstanceAccessor<&RemoteWrap::Length>("length"),
                         InstanceMethod<&RemoteWrap::Close>("close"),
                     });
}

RemoteWrap::RemoteWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<RemoteWrap>(info) {
  if (!IsInternalCall(info)) {
    throw MakeError(info.Env(), "ERR_INVALID_ARGUMENT",
                    "RemoteRegion handles come from Endpoint.importRemote");
  }
  TagObject(info.Env(), info.This().As<Napi::Object>(), kRemoteTag);
}

Napi::Value RemoteWrap::Length(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(length_));
}

void RemoteWrap::OpDone() {
  inflight_--;
  if (inflight_ == 0 && state_ == HandleState::kClosing) Release();
}

void RemoteWrap::Release() {
  if (state_ == HandleState::kClosed) return;
  state_ = HandleState::kClosed;
  // After the agent closed, the engine destroyed every rkey it held.
  if (agent_ && agent_->engine() && rkey_) agent_->engine()->DestroyRkey(rkey_);
  rkey_ = nullptr;
  if (agent_) agent_->Forget(this);
  agent_ = nullptr;
}

Napi::Value RemoteWrap::Close(const Napi::CallbackInfo& info) {
  if (state_ == HandleState::kOpen) {
    state_ = HandleState::kClosing;
    if (inflight_ == 0) Release();
  }
  return info.Env().Undefined();
}

}  // namespace kvxfer
