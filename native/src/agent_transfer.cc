// The agent's transfer methods: each call's arguments (endpoint, regions, descriptors,
// notification) checked completely on the JavaScript thread and copied into a TransferOp, then
// handed to the progress engine: transfer(), transferMany(), writeParts(), notify(), and prepare()
// for a PreparedTransfer (xfer.h) posted again and again.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "agent.h"
#include "descriptors.h"
#include "region.h"
#include "remote_region.h"
#include "wire.h"
#include "xfer.h"

namespace kvxfer {

namespace {

template <typename W>
W* UnwrapHandle(Napi::Env env, const Napi::Value& v, const napi_type_tag& tag, const char* what) {
  if (!HasTag(env, v, tag)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    std::string(what) + " is not a kvxfer handle of the right kind");
  }
  return W::Unwrap(v.As<Napi::Object>());
}

}  // namespace

void AgentWrap::AddSegment(Napi::Env env, const char* what, const std::string& where,
                           EndpointWrap* ep, const Napi::Value& local_v,
                           const Napi::Value& remote_v, const Napi::Value& descs, TransferOp* op,
                           std::vector<RegionWrap*>* locals, std::vector<RemoteWrap*>* remotes) {
  auto* local = UnwrapHandle<RegionWrap>(env, local_v, kRegionTag, "local region");
  auto* remote = UnwrapHandle<RemoteWrap>(env, remote_v, kRemoteTag, "remote region");
  if (local->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the local region is closed");
  if (remote->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the remote region is closed");
  if (local->agent_ != this || remote->agent_ != this) {
    throw MakeError(env, "ERR_WRONG_AGENT",
                    std::string(what) + ": a handle belongs to another agent");
  }
  if (remote->ep_ != ep->core_) {
    throw MakeError(env, "ERR_ENDPOINT_MISMATCH",
                    std::string(what) + ": the remote region was imported on another endpoint");
  }
  std::vector<uint64_t> d;
  ReadDescriptors(env, descs, local->length(), remote->length_, &d, where);
  // The operation holds every handle it names, even one with nothing to move.
  locals->push_back(local);
  remotes->push_back(remote);
  if (d.empty()) return;  // nothing to move for this pair: no segment (segments are never empty)
  op->desc.insert(op->desc.end(), d.begin(), d.end());
  TransferOp::Segment sg;
  sg.local_base = local->base();
  sg.local_memh = local->memh();
  sg.remote_base = remote->address_;
  sg.rkey = remote->rkey_;
  sg.end = op->desc.size() / 3;
  op->segs.push_back(sg);
}

EndpointWrap* AgentWrap::OpenEndpoint(Napi::Env env, const Napi::Value& v, const char* what) {
  auto* ep = UnwrapHandle<EndpointWrap>(env, v, kEndpointTag, "endpoint");
  if (ep->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the endpoint is closed");
  if (ep->agent_ != this)
    throw MakeError(env, "ERR_WRONG_AGENT",
                    std::string(what) + ": the endpoint belongs to another agent");
  return ep;
}

void AgentWrap::SetNotification(Napi::Env env, const char* what, const Napi::Value& v,
                                TransferOp* op) {
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (!BytesOf(v, &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    std::string(what) + ": notification must be a Buffer or Uint8Array");
  }
  if (size > engine_->max_notification_bytes()) {
    throw MakeError(env, "ERR_NOTIFICATION_TOO_LARGE",
                    "notification of " + std::to_string(size) + " bytes exceeds the limit of " +
                        std::to_string(engine_->max_notification_bytes()),
                    UCS_OK, true);
  }
  op->notification.assign(data, data + size);
  op->has_notification = true;
}

// One write or read from its arguments (kind: 0 write | 1 read, endpoint, local, remote,
// descriptors, notification?), checked completely; `what` leads its errors.
AgentWrap::Built AgentWrap::BuildTransfer(Napi::Env env, const std::string& what,
                                          const Napi::Value* args, size_t n) {
  if (n < 5 || !args[0].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    what + "(kind, endpoint, local, remote, descriptors, notification?)");
  }
  int kind = args[0].As<Napi::Number>().Int32Value();
  if (kind != 0 && kind != 1)
    throw MakeError(env, "ERR_INVALID_ARGUMENT", what + ": kind must be 0 (write) or 1 (read)");
  Built b;
  b.ep = OpenEndpoint(env, args[1], what.c_str());
  b.op = std::make_unique<TransferOp>();
  AddSegment(env, what.c_str(), what == "transfer" ? "" : what + ": ", b.ep, args[2], args[3],
             args[4], b.op.get(), &b.locals, &b.remotes);
  if (n >= 6 && !args[5].IsUndefined() && !args[5].IsNull()) {
    if (kind != 0)
      throw MakeError(env, "ERR_INVALID_ARGUMENT", what + ": only a write carries a notification");
    SetNotification(env, what.c_str(), args[5], b.op.get());
  }
  if (b.ep->core_->failed.load()) {
    throw UcsError(env, what + ": the endpoint has failed", b.ep->core_->fail_status);
  }
  b.op->kind = kind == 0 ? OpKind::kWrite : OpKind::kRead;
  b.op->ep = b.ep->core_;
  return b;
}

AgentWrap::Built AgentWrap::BuildTransfer(const Napi::CallbackInfo& info, const std::string& what) {
  Napi::Value args[6];
  const size_t n = std::min<size_t>(info.Length(), 6);
  for (size_t i = 0; i < n; ++i) args[i] = info[i];
  return BuildTransfer(info.Env(), what, args, n);
}

// transfer(kind: 0 write | 1 read, endpoint, localRegion, remoteRegion, descriptors, notification?)
Napi::Value AgentWrap::Transfer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "transfer");
  Built b = BuildTransfer(info, "transfer");
  Napi::Value promise = Track(env, b.op.get(), b.ep, std::move(b.locals), std::move(b.remotes));
  engine_->Submit(std::move(b.op));
  return promise;
}

// transferMany([[kind, endpoint, local, remote, descriptors, notification?], ...]): every entry
// checked first (a bad one refuses them all, naming it, before anything is posted), then all
// handed to the progress thread in one command and one wake-up. Returns one promise per entry.
Napi::Value AgentWrap::TransferMany(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "transferMany");
  if (info.Length() < 1 || !info[0].IsArray()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "transferMany([[kind, endpoint, local, remote, descriptors, notification?], "
                    "...])");
  }
  Napi::Array entries = info[0].As<Napi::Array>();
  const uint32_t count = entries.Length();
  std::vector<Built> built;
  built.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    Napi::Value e = entries.Get(i);
    const std::string what = "transferMany entry " + std::to_string(i);
    if (!e.IsArray()) throw MakeError(env, "ERR_INVALID_ARGUMENT", what + " is not an array");
    Napi::Array a = e.As<Napi::Array>();
    Napi::Value args[6];
    const size_t n = std::min<uint32_t>(a.Length(), 6);
    for (uint32_t k = 0; k < n; ++k) args[k] = a.Get(k);
    built.push_back(BuildTransfer(env, what, args, n));
  }
  Napi::Array promises = Napi::Array::New(env, count);
  std::vector<std::unique_ptr<TransferOp>> ops;
  ops.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    Built& b = built[i];
    promises.Set(i, Track(env, b.op.get(), b.ep, std::move(b.locals), std::move(b.remotes)));
    ops.push_back(std::move(b.op));
  }
  if (!ops.empty()) engine_->SubmitMany(std::move(ops));
  return promises;
}

// prepare(kind, endpoint, local, remote, descriptors, notification?): the transfer checked once,
// as transfer() checks it, and kept as a PreparedTransfer to post() again and again.
Napi::Value AgentWrap::Prepare(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "prepare");
  Built b = BuildTransfer(info, "prepare");
  b.op->id = next_op_id_++;
  Napi::Object obj = data_->xfer_ctor.New({Napi::Number::New(env, kCtorToken)});
  XferWrap* x = XferWrap::Unwrap(obj);
  x->Init(env, std::move(b.op), b.ep, std::move(b.locals), std::move(b.remotes));
  Adopt(x);
  return obj;
}

void AgentWrap::PostPrepared(Napi::Env env, std::unique_ptr<TransferOp> op) {
  ++prepared_posted_;
  UpdateRef(env);
  engine_->Submit(std::move(op));
}

// writeParts(endpoint, [[localRegion, remoteRegion, descriptors], ...], notification?): every
// part's puts in order, one flush, then the notification if any: one operation (one hand-off to
// the progress thread, one completion back) for all of a rank pair's region pairs.
Napi::Value AgentWrap::WriteParts(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "writeParts");
  if (info.Length() < 2 || !info[1].IsArray()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "writeParts(endpoint, [[local, remote, descriptors], ...], notification?)");
  }
  EndpointWrap* ep = OpenEndpoint(env, info[0], "writeParts");
  auto op = std::make_unique<TransferOp>();
  std::vector<RegionWrap*> locals;
  std::vector<RemoteWrap*> remotes;
  Napi::Array parts = info[1].As<Napi::Array>();
  for (uint32_t i = 0; i < parts.Length(); ++i) {
    Napi::Value part = parts.Get(i);
    if (!part.IsArray() || part.As<Napi::Array>().Length() != 3) {
      throw MakeError(env, "ERR_INVALID_ARGUMENT",
                      "writeParts: part " + std::to_string(i) +
                          " is not a [local, remote, descriptors] triple");
    }
    Napi::Array p = part.As<Napi::Array>();
    const std::string what = "writeParts part " + std::to_string(i);
    AddSegment(env, what.c_str(), what + ": ", ep, p.Get(0u), p.Get(1u), p.Get(2u), op.get(),
               &locals, &remotes);
  }
  if (info.Length() >= 3 && !info[2].IsUndefined() && !info[2].IsNull())
    SetNotification(env, "writeParts", info[2], op.get());
  if (ep->core_->failed.load()) {
    throw UcsError(env, "writeParts: the endpoint has failed", ep->core_->fail_status);
  }
  op->kind = OpKind::kWrite;
  op->ep = ep->core_;
  Napi::Value promise = Track(env, op.get(), ep, std::move(locals), std::move(remotes));
  engine_->Submit(std::move(op));
  return promise;
}

// notify(endpoint, bytes)
Napi::Value AgentWrap::Notify(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "notify");
  if (info.Length() < 2) throw MakeError(env, "ERR_INVALID_ARGUMENT", "notify(endpoint, bytes)");
  EndpointWrap* ep = OpenEndpoint(env, info[0], "notify");
  auto op = std::make_unique<TransferOp>();
  SetNotification(env, "notify", info[1], op.get());
  if (ep->core_->failed.load())
    throw UcsError(env, "notify: the endpoint has failed", ep->core_->fail_status);
  op->kind = OpKind::kNotify;
  op->ep = ep->core_;
  Napi::Value promise = Track(env, op.get(), ep, {}, {});
  engine_->Submit(std::move(op));
  return promise;
}

}  // namespace kvxfer
