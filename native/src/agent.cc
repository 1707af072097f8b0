// The Agent object itself: its construction and accessors, connect(), progress() and close(), and
// the operations it tracks from submission until the engine hands them back (Track, Deliver,
// Settle). Its memory and transfer methods are in agent_memory.cc, agent_transfer.cc and
// agent_cuda.cc.
#include "agent.h"

#include <string>
#include <utility>
#include <vector>

#include "ucx_status.h"
#include "wire.h"
#include "xfer.h"

namespace kvxfer {

Napi::Function AgentWrap::Define(Napi::Env env) {
  return DefineClass(env, "Agent",
                     {
                         InstanceAccessor<&AgentWrap::Address>("address"),
                         InstanceAccessor<&AgentWrap::Name>("name"),
                         InstanceAccessor<&AgentWrap::Inflight>("inflight"),
                         InstanceAccessor<&AgentWrap::InlinePosts>("inlinePosts"),
                         InstanceAccessor<&AgentWrap::LoopTurns>("loopTurns"),
                         InstanceAccessor<&AgentWrap::Transports>("transports"),
                         InstanceAccessor<&AgentWrap::MemoryTypes>("memoryTypes"),
                         InstanceMethod<&AgentWrap::RegisterMemory>("registerMemory"),
                         InstanceMethod<&AgentWrap::RegisterAddress>("registerAddress"),
                         InstanceMethod<&AgentWrap::OpenCudaIpc>("openCudaIpc"),
                         InstanceMethod<&AgentWrap::AllocateCuda>("allocateCuda"),
                         InstanceMethod<&AgentWrap::MapFile>("mapFile"),
                         InstanceMethod<&AgentWrap::Allocate>("allocate"),
                         InstanceMethod<&AgentWrap::AttachSegment>("attachSegment"),
                         InstanceMethod<&AgentWrap::Connect>("connect"),
                         InstanceMethod<&AgentWrap::Transfer>("transfer"),
                         InstanceMethod<&AgentWrap::TransferMany>("transferMany"),
                         InstanceMethod<&AgentWrap::Prepare>("prepare"),
                         InstanceMethod<&AgentWrap::Progress>("progress"),
                         InstanceMethod<&AgentWrap::WatchPrepared>("watchPrepared"),
                         InstanceMethod<&AgentWrap::WriteParts>("writeParts"),
                         InstanceMethod<&AgentWrap::Notify>("notify"),
                         InstanceMethod<&AgentWrap::Close>("close"),
                         InstanceMethod<&AgentWrap::BeginClose>("beginClose"),
                     });
}

// new Agent({ name, transports, netDevices, busyPoll, spinUs, tcpUserTimeoutMs,
//             maxNotificationBytes }, onEvents)
AgentWrap::AgentWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<AgentWrap>(info) {
  Napi::Env env = info.Env();
  data_ = env.GetInstanceData<AddonData>();
  if (info.Length() < 2 || !info[0].IsObject() || !info[1].IsFunction()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "Agent(options, onEvents) expects an object and a function");
  }
  Napi::Object o = info[0].As<Napi::Object>();
  EngineOptions opts;
  auto str = [&](const char* key) -> std::string {
    Napi::Value v = o.Get(key);
    return v.IsString() ? v.As<Napi::String>().Utf8Value() : std::string();
  };
  opts.name = str("name");
  opts.transports = str("transports");
  opts.net_devices = str("netDevices");
  opts.busy_poll = o.Get("busyPoll").ToBoolean().Value();
  opts.caller_progress = str("progress") == "caller";
  Napi::Value inline_post = o.Get("inlinePost");
  opts.inline_post = inline_post.IsUndefined() || inline_post.ToBoolean().Value();
  Napi::Value loop_wake = o.Get("loopWake");
  opts.loop_wake = loop_wake.ToBoolean().Value();
  Napi::Value spin = o.Get("spinUs");
  if (spin.IsNumber() && spin.As<Napi::Number>().Int64Value() > 0) {
    opts.spin_after_activity = std::chrono::microseconds(spin.As<Napi::Number>().Int64Value());
  }
  Napi::Value user_timeout = o.Get("tcpUserTimeoutMs");
  if (user_timeout.IsNumber() && user_timeout.As<Napi::Number>().Int64Value() > 0) {
    opts.tcp_user_timeout_ms = static_cast<uint64_t>(user_timeout.As<Napi::Number>().Int64Value());
  }
  Napi::Value maxn = o.Get("maxNotificationBytes");
  if (maxn.IsNumber()) opts.max_notification_bytes = maxn.As<Napi::Number>().Int64Value();

  ucs_status_t status = UCS_OK;
  std::string what;
  engine_ = ProgressEngine::Create(opts, &status, &what);
  if (!engine_) throw UcsError(env, "cannot create UCX agent: " + what, status);

  on_event_ = Napi::Persistent(info[1].As<Napi::Function>());
  link_ = std::make_shared<AgentLink>();
  link_->agent = this;
  tsfn_ = Napi::ThreadSafeFunction::New(
      env, Napi::Function::New(env, [](const Napi::CallbackInfo&) {}), "kvxfer-progress", 0, 1);
  tsfn_.Unref(env);
  auto link = link_;
  Napi::ThreadSafeFunction tsfn = tsfn_;
  engine_->Start([tsfn, link]() mutable {
    tsfn.NonBlockingCall([link](Napi::Env env, Napi::Function) {
      if (link->agent == nullptr) return;
      try {
        link->agent->Deliver(env);
      } catch (const Napi::Error& e) {
        // Nothing may leave this callback as a C++ exception (std::terminate). JavaScript could
        // not run (the process is exiting with a batch still queued: napi_cannot_run_js), or
        // onEvents threw: hand that error on as an uncaught exception, through the C API, which
        // reports instead of throwing; during teardown it is dropped.
        napi_value value = e.Value();
        if (value != nullptr) napi_throw(env, value);
      }
    });
  });
  StartLoopWatch(env);
  data_->agents.insert(this);
}

void AgentWrap::StartLoopWatch(Napi::Env env) {
  if (engine_->loop_fd() < 0) return;
  uv_loop_t* loop = nullptr;
  if (napi_get_uv_event_loop(env, &loop) != napi_ok || loop == nullptr) return;
  auto* watch = new LoopWatch();
  watch->link = link_;
  watch->handle.data = watch;
  if (uv_poll_init(loop, &watch->handle, engine_->loop_fd()) != 0) {
    delete watch;  // never initialised: nothing for libuv to close
    return;        // the progress thread alone hands events over, as without loop_wake
  }
  loop_env_ = env;
  loop_context_ = std::make_unique<Napi::AsyncContext>(env, "kvxfer-worker");
  uv_poll_start(&watch->handle, UV_READABLE, [](uv_poll_t* h, int status, int events) {
    auto* w = static_cast<LoopWatch*>(h->data);
    if (w->link->agent != nullptr) w->link->agent->OnWorkerReadable();
  });
  // The watch alone never keeps the process alive (transfers in flight do, through tsfn_).
  uv_unref(reinterpret_cast<uv_handle_t*>(&watch->handle));
  loop_watch_ = watch;
}

void AgentWrap::StopLoopWatch() {
  if (loop_watch_ == nullptr) return;
  uv_poll_stop(&loop_watch_->handle);
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_watch_->handle),
           [](uv_handle_t* h) { delete static_cast<LoopWatch*>(h->data); });
  loop_watch_ = nullptr;
}

void AgentWrap::OnWorkerReadable() {
  if (state_ != HandleState::kOpen || !engine_) return;
  engine_->LoopTurn();
  if (!engine_->events_pending()) return;
  Napi::Env env(loop_env_);
  Napi::HandleScope scope(env);
  // As a thread-safe call's: promise reactions and process.nextTick callbacks run when it closes.
  Napi::CallbackScope callback_scope(env, *loop_context_);
  try {
    Deliver(env);
  } catch (const Napi::Error& e) {
    // onEvents threw: an uncaught exception, as from any other callback.
    napi_value value = e.Value();
    if (value != nullptr) napi_fatal_exception(env, value);
  }
}

AgentWrap::~AgentWrap() {
  if (state_ != HandleState::kClosed) CloseAll(Env(), false);
}

void AgentWrap::CheckOpen(Napi::Env env, const char* what) {
  if (state_ != HandleState::kOpen) {
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the agent is closed");
  }
}

Napi::Value AgentWrap::Address(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "address");
  std::vector<uint8_t> blob = WrapAddress(engine_->worker_address());
  return Napi::Buffer<uint8_t>::Copy(info.Env(), blob.data(), blob.size());
}

Napi::Value AgentWrap::Name(const Napi::CallbackInfo& info) {
  return Napi::String::New(info.Env(), engine_ ? engine_->name() : std::string());
}

Napi::Value AgentWrap::Inflight(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(pending_.size()));
}

Napi::Value AgentWrap::InlinePosts(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(),
                           engine_ ? static_cast<double>(engine_->inline_posts()) : 0.0);
}

Napi::Value AgentWrap::LoopTurns(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), engine_ ? static_cast<double>(engine_->loop_turns()) : 0.0);
}

Napi::Value AgentWrap::Transports(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "transports");
  return StringArray(info.Env(), engine_->context_info().resources);
}

Napi::Value AgentWrap::MemoryTypes(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "memoryTypes");
  return StringArray(info.Env(), MemoryTypeNames(engine_->context_info().memory_types));
}

// connect(addressBlob, errorMode: "none" | "peer")
Napi::Value AgentWrap::Connect(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "connect");
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (info.Length() < 1 || !BytesOf(info[0], &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT", "connect expects the peer's address as a Buffer");
  }
  bool peer_mode = false;
  if (info.Length() >= 2 && info[1].IsString()) {
    std::string mode = info[1].As<Napi::String>().Utf8Value();
    if (mode == "peer") {
      peer_mode = true;
    } else if (mode != "none") {
      throw MakeError(env, "ERR_INVALID_ARGUMENT",
                      "connect: errorMode must be 'none' or 'peer', got '" + mode + "'");
    }
  }
  std::vector<uint8_t> raw;
  if (!UnwrapAddress(data, size, &raw)) {
    throw MakeError(env, "ERR_BAD_ADDRESS",
                    "connect: not a kvxfer worker address (bad magic, length or checksum; " +
                        std::to_string(size) + " bytes)");
  }
  std::shared_ptr<EndpointCore> core;
  ucs_status_t status = engine_->CreateEndpoint(raw, peer_mode, &core);
  if (status != UCS_OK) throw UcsError(env, "connect: ucp_ep_create failed", status);
  Napi::Object obj = data_->endpoint_ctor.New({Napi::Number::New(env, kCtorToken)});
  EndpointWrap* ep = EndpointWrap::Unwrap(obj);
  ep->core_ = core;
  Adopt(ep);
  Register(ep);
  return obj;
}

// progress(): in caller-progress mode, posts what is queued, progresses the worker until idle and
// delivers what completed (promises settled, notifications to onEvents), all on this thread.
// Returns the number of operations settled. In the default mode it only delivers what the
// progress thread has queued.
// watchPrepared(on): whether delivered prepared transfers are also reported to JavaScript, as one
// `prepared` event per batch (the Agent turns it on while it has a listener for it).
Napi::Value AgentWrap::WatchPrepared(const Napi::CallbackInfo& info) {
  watch_prepared_ = info.Length() > 0 && info[0].ToBoolean().Value();
  return info.Env().Undefined();
}

Napi::Value AgentWrap::Progress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (state_ != HandleState::kOpen || !engine_) return Napi::Number::New(env, 0);
  if (engine_->caller_progress()) engine_->Progress();
  return Napi::Number::New(env, static_cast<double>(Deliver(env)));
}

Napi::Value AgentWrap::Track(Napi::Env env, TransferOp* op, EndpointWrap* ep,
                             std::vector<RegionWrap*> locals, std::vector<RemoteWrap*> remotes) {
  uint64_t id = next_op_id_++;
  op->id = id;
  auto pending = std::make_unique<Pending>(env);
  pending->kind = op->kind;
  pending->held.Hold(ep, std::move(locals), std::move(remotes));
  Napi::Promise promise = pending->deferred.Promise();
  pending_[id] = std::move(pending);
  UpdateRef(env);
  return promise;
}

void AgentWrap::UpdateRef(Napi::Env env) {
  // Keep the process alive while transfers are in flight, not while idle.
  bool want = (!pending_.empty() || prepared_posted_ > 0) && state_ == HandleState::kOpen;
  if (want != tsfn_ref_) {
    if (want) {
      tsfn_.Ref(env);
    } else {
      tsfn_.Unref(env);
    }
    tsfn_ref_ = want;
  }
}

namespace {

// The operation's steps for JavaScript, in microseconds of CLOCK_MONOTONIC (0: not reached): a
// Float64Array of the eight steps in OpTrace's order (src/native/trace.ts names them), a view into
// its delivery batch's one buffer (Deliver). An object took a property set per step; a buffer per
// completion cost an allocation, a free and V8's sweeping of each (together 0.6 µs of a 4 KiB
// write's 4.5 with promises, measured with perf and bench peers).
Napi::Float64Array TraceObject(Napi::Env env, const OpTrace& t, uint64_t delivered,
                               Napi::ArrayBuffer& batch, size_t index) {
  auto* out = static_cast<double*>(batch.Data()) + 8 * index;
  const uint64_t values[] = {t.submitted, t.started,  t.first_post, t.posted,
                             t.flushed,   t.notified, t.completed,  delivered};
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<double>(values[i]);
  return Napi::Float64Array::New(env, 8, batch, 8 * sizeof(double) * index);
}

}  // namespace

void AgentWrap::Settle(Napi::Env env, const Event& ev, uint64_t delivered_us,
                       Napi::ArrayBuffer& traces, size_t* used) {
  auto it = pending_.find(ev.id);
  if (it == pending_.end()) return;
  std::unique_ptr<Pending> p = std::move(it->second);
  pending_.erase(it);
  p->held.Release();
  if (ev.status == UCS_OK) {
    p->deferred.Resolve(TraceObject(env, ev.trace, delivered_us, traces, (*used)++));
  } else if (ev.status == UCS_ERR_CANCELED &&
             (state_ != HandleState::kOpen || engine_->shutdown_requested())) {
    p->deferred.Reject(
        MakeError(env, "ERR_CLOSED", "transfer cancelled: the agent was closed").Value());
  } else {
    const char* what = p->kind == OpKind::kWrite  ? "write"
                       : p->kind == OpKind::kRead ? "read"
                                                  : "notify";
    p->deferred.Reject(UcsError(env, std::string(what) + " failed", ev.status).Value());
  }
}

size_t AgentWrap::Deliver(Napi::Env env) {
  if (!engine_) return 0;
  std::vector<Event>& events = delivering_;
  events.clear();
  engine_->TakeEvents(&events);
  if (events.empty()) return 0;
  size_t settled = 0;
  const uint64_t delivered_us = MonoUs();
  Napi::HandleScope scope(env);
  // One buffer for the traces of every completion in this batch (each gets a view of its slot).
  size_t completions = 0;
  for (const Event& ev : events) completions += ev.kind == Event::Kind::kCompletion;
  Napi::ArrayBuffer traces;
  if (completions > 0) traces = Napi::ArrayBuffer::New(env, completions * 8 * sizeof(double));
  size_t traces_used = 0;
  Napi::Array batch = Napi::Array::New(env);
  // Prepared transfers back, when JavaScript watches them: done, and failed or lost (both made
  // at the first one).
  Napi::Array done;
  Napi::Array failed;
  uint32_t n = 0;
  for (Event& ev : events) {
    switch (ev.kind) {
      case Event::Kind::kPrepared: {
        --prepared_posted_;
        auto* xfer = static_cast<XferWrap*>(ev.owner);
        // Its object, taken while the transfer still holds it (Returned lets go of it).
        Napi::Object obj = xfer->Value();
        const bool ok = ev.status == UCS_OK && ev.op != nullptr;
        xfer->Returned(std::move(ev.op), ev.status);
        ++settled;
        if (watch_prepared_ && xfer->open()) {
          if (done.IsEmpty()) {
            done = Napi::Array::New(env);
            failed = Napi::Array::New(env);
          }
          Napi::Array& to = ok ? done : failed;
          to.Set(to.Length(), obj);
        }
        break;
      }
      case Event::Kind::kCompletion:
        Settle(env, ev, delivered_us, traces, &traces_used);
        ++settled;
        break;
      case Event::Kind::kNotification: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "notification");
        o.Set("peer", Napi::String::New(env, ev.peer));
        o.Set("data", Napi::Buffer<uint8_t>::Copy(env, ev.bytes.data(), ev.bytes.size()));
        o.Set("receivedUs", Napi::Number::New(env, static_cast<double>(ev.received_us)));
        o.Set("deliveredUs", Napi::Number::New(env, static_cast<double>(delivered_us)));
        batch.Set(n++, o);
        break;
      }
      case Event::Kind::kDropped: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "notificationDropped");
        o.Set("peer", Napi::String::New(env, ev.peer));
        o.Set("bytes", Napi::Number::New(env, static_cast<double>(ev.id)));
        batch.Set(n++, o);
        break;
      }
      case Event::Kind::kEndpointFailed: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "endpointFailed");
        o.Set("endpointId", Napi::Number::New(env, static_cast<double>(ev.id)));
        o.Set("code", Napi::String::New(env, UcsStatusName(ev.status)));
        o.Set("ucsStatus", Napi::Number::New(env, static_cast<int>(ev.status)));
        batch.Set(n++, o);
        break;
      }
      case Event::Kind::kEndpointSettled: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "endpointSettled");
        o.Set("endpointId", Napi::Number::New(env, static_cast<double>(ev.id)));
        o.Set("seq", Napi::Number::New(env, static_cast<double>(ev.seq)));
        o.Set("code", Napi::String::New(env, UcsStatusName(ev.status)));
        batch.Set(n++, o);
        break;
      }
    }
  }
  if (!done.IsEmpty()) {
    // One event for the batch (one wake-up): the transfers whose last post completed, and those
    // whose last post failed or was lost (apart, so that nobody asks each its state).
    Napi::Object o = Napi::Object::New(env);
    o.Set("type", "prepared");
    o.Set("done", done);
    o.Set("failed", failed);
    batch.Set(n++, o);
  }
  UpdateRef(env);
  if (n > 0 && !on_event_.IsEmpty() && state_ == HandleState::kOpen) {
    on_event_.Call({batch});
  }
  return settled;
}

void AgentWrap::CloseAll(Napi::Env env, bool deliver) {
  if (state_ == HandleState::kClosed) return;
  state_ = HandleState::kClosing;
  data_->agents.erase(this);
  link_->agent = nullptr;
  StopLoopWatch();
  // Stops the thread: queued transfers are cancelled, endpoints closed.
  engine_->Shutdown();
  if (deliver) {
    Deliver(env);
  } else {
    std::vector<Event> dropped;
    engine_->TakeEvents(&dropped);
  }
  pending_.clear();
  // The worker goes before the regions: purging its pending requests may touch their handles.
  engine_->DestroyWorker();
  std::vector<Child*> children(children_.begin(), children_.end());
  for (Child* c : children) c->CloseFromParent(deliver);
  children_.clear();
  endpoints_.clear();
  if (tsfn_ref_ && deliver) tsfn_.Unref(env);
  tsfn_ref_ = false;
  tsfn_.Release();
  engine_.reset();
  loop_context_.reset();
  state_ = HandleState::kClosed;
}

Napi::Value AgentWrap::Close(const Napi::CallbackInfo& info) {
  CloseAll(info.Env(), true);
  return info.Env().Undefined();
}

// beginClose(): starts the shutdown (cancels what is queued, starts the deadline) without
// waiting; close() then waits for it.
Napi::Value AgentWrap::BeginClose(const Napi::CallbackInfo& info) {
  if (state_ == HandleState::kOpen && engine_) engine_->RequestShutdown();
  return info.Env().Undefined();
}

}  // namespace kvxfer
