#include "endpoint.h"

#include <string>

#include "region.h"
#include "remote_region.h"
#include "wire.h"

namespace kvxfer {

Napi::Function EndpointWrap::Define(Napi::Env env) {
  return DefineClass(env, "Endpoint",
                     {
                         InstanceAccessor<&EndpointWrap::Id>("id"),
                         InstanceAccessor<&EndpointWrap::State>("state"),
                         InstanceMethod<&EndpointWrap::ImportRemote>("importRemote"),
                         InstanceMethod<&EndpointWrap::Close>("close"),
                         InstanceMethod<&EndpointWrap::Abandon>("abandon"),
                         InstanceMethod<&EndpointWrap::Settle>("settle"),
                     });
}

EndpointWrap::EndpointWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<EndpointWrap>(info) {
  if (!IsInternalCall(info)) {
    throw MakeError(info.Env(), "ERR_INVALID_ARGUMENT", "Endpoint handles come from Agent.connect");
  }
  TagObject(info.Env(), info.This().As<Napi::Object>(), kEndpointTag);
}

Napi::Value EndpointWrap::Id(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), core_ ? static_cast<double>(core_->id) : 0);
}

Napi::Value EndpointWrap::State(const Napi::CallbackInfo& info) {
  const char* s = state_ != HandleState::kOpen      ? "closed"
                  : (core_ && core_->failed.load()) ? "failed"
                                                    : "connected";
  return Napi::String::New(info.Env(), s);
}

void EndpointWrap::OpDone() {
  inflight_--;
  if (inflight_ == 0 && state_ == HandleState::kClosing) Release();
}

void EndpointWrap::Release() {
  if (state_ == HandleState::kClosed) return;
  state_ = HandleState::kClosed;
  if (agent_) {
    // After the agent has shut its engine down, its endpoints are closed already.
    if (agent_->engine() && agent_->open() && core_) agent_->engine()->CloseEndpoint(core_);
    agent_->Unregister(this);
    agent_->Forget(this);
  }
  agent_ = nullptr;
}

namespace {
// The optional settle number of abandon(seq) / settle(seq): a positive integer, else 0.
uint64_t SeqArg(const Napi::CallbackInfo& info) {
  if (info.Length() < 1 || !info[0].IsNumber()) return 0;
  double d = info[0].As<Napi::Number>().DoubleValue();
  return d >= 1 && d <= 9007199254740991.0 ? static_cast<uint64_t>(d) : 0;
}
}  // namespace

// abandon(seq?): fails every transfer on this endpoint now (UCS_ERR_CONNECTION_RESET) and marks it
// failed; for a peer known dead whose operations UCX would never complete. With `seq`, an
// `endpointSettled` event with that seq follows once UCX holds none of them any more (they may
// still move bytes until then). Returns whether that event will come (false: the endpoint was
// closed with nothing in flight, or its agent is). Idempotent.
Napi::Value EndpointWrap::Abandon(const Napi::CallbackInfo& info) {
  if (state_ != HandleState::kClosed && agent_ && agent_->engine() && agent_->open() && core_) {
    uint64_t seq = SeqArg(info);
    agent_->engine()->AbandonEndpoint(core_, UCS_ERR_CONNECTION_RESET, seq);
    return Napi::Boolean::New(info.Env(), seq != 0);
  }
  return Napi::Boolean::New(info.Env(), false);
}

// settle(seq): an `endpointSettled` event with `seq` once every operation posted on this endpoint
// so far is over in UCX. Returns false (no event) when the endpoint or its agent is closed.
Napi::Value EndpointWrap::Settle(const Napi::CallbackInfo& info) {
  uint64_t seq = SeqArg(info);
  if (seq != 0 && state_ != HandleState::kClosed && agent_ && agent_->engine() && agent_->open() &&
      core_) {
    agent_->engine()->SettleEndpoint(core_, seq);
    return Napi::Boolean::New(info.Env(), true);
  }
  return Napi::Boolean::New(info.Env(), false);
}

// importRemote(remoteKeyBlob): a peer's region, usable on this endpoint.
Napi::Value EndpointWrap::ImportRemote(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (state_ != HandleState::kOpen || !agent_ || !agent_->open()) {
    throw MakeError(env, "ERR_CLOSED", "importRemote: the endpoint is closed");
  }
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (info.Length() < 1 || !BytesOf(info[0], &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "importRemote expects the peer's remote key as a Buffer");
  }
  RemoteBlob blob;
  if (!UnwrapRemote(data, size, &blob)) {
    throw MakeError(env, "ERR_BAD_REMOTE_KEY",
                    "importRemote: not a kvxfer remote key (bad magic, length or checksum; " +
                        std::to_string(size) + " bytes)");
  }
  ucp_rkey_h rkey = nullptr;
  ucs_status_t status = agent_->engine()->UnpackRkey(core_, blob.rkey, &rkey);
  if (status != UCS_OK) throw UcsError(env, "importRemote: ucp_ep_rkey_unpack failed", status);
  if (info.Length() >= 2 && info[1].ToBoolean().Value()) PopulateMapped(rkey, blob);
  auto* addon = env.GetInstanceData<AddonData>();
  Napi::Object obj = addon->remote_ctor.New({Napi::Number::New(env, kCtorToken)});
  RemoteWrap* remote = RemoteWrap::Unwrap(obj);
  remote->ep_ = core_;
  remote->rkey_ = rkey;
  remote->address_ = blob.address;
  remote->length_ = blob.length;
  agent_->Adopt(remote);
  return obj;
}

// When UCX mapped the peer's whole region into this process (its shared-memory transports do,
// for memory the peer allocated through UCX), faults its pages in now, so that the first
// WRITE into each page does not take a page fault inside a transfer. Nothing happens unless both
// ends of the region, as the peer declared it, lie in one contiguous mapping UCX made for this
// key: a peer that overstates its length gets no populate, and nothing outside the mapping is
// touched.
void EndpointWrap::PopulateMapped(ucp_rkey_h rkey, const RemoteBlob& blob) {
  if (blob.length == 0 || blob.address + blob.length < blob.address) return;
  void* first = nullptr;
  void* last = nullptr;
  if (ucp_rkey_ptr(rkey, blob.address, &first) != UCS_OK) return;
  if (ucp_rkey_ptr(rkey, blob.address + blob.length - 1, &last) != UCS_OK) return;
  auto lo = reinterpret_cast<uintptr_t>(first);
  auto hi = reinterpret_cast<uintptr_t>(last);
  if (hi < lo || hi - lo != blob.length - 1) return;
  PopulateWrite(first, blob.length);
}

Napi::Value EndpointWrap::Close(const Napi::CallbackInfo& info) {
  if (state_ == HandleState::kOpen) {
    state_ = HandleState::kClosing;
    if (inflight_ == 0) Release();
  }
  return info.Env().Undefined();
}

}  // namespace kvxfer
