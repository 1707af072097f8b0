#include "progress.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>

namespace kvxfer {

namespace {

// Descriptors posted per transfer per loop turn: large enough to keep the
// transport busy, small enough that commands and other transfers interleave.
constexpr size_t kPostChunk = 512;
// ...and at most this many bytes: on shared memory a put copies synchronously,
// so one turn over large descriptors would otherwise hold notifications
// (heartbeats included) back for as long as the whole transfer takes.
constexpr uint64_t kPostChunkBytes = 8ull << 20;
// A sleeping loop wakes at least this often, so a missed wake-up costs
// latency, never a hang.
constexpr int kSleepBoundMs = 100;
// How long Shutdown() waits for in-flight operations and endpoint closes. Measured here: 20
// writes of 20 000 descriptors cancelled by a close took over 2 s to flush on a loaded 2-core VM.
constexpr auto kShutdownDeadline = std::chrono::seconds(10);
// After the last endpoint closed: how long, and for how many idle progress calls, the worker is
// still progressed before it is destroyed (DrainWorker).
constexpr auto kDrainBound = std::chrono::milliseconds(200);

constexpr int kDrainIdleCalls = 20;
// How long RunSync() waits for the progress thread.
constexpr auto kRunSyncDeadline = std::chrono::seconds(30);

struct ConfigHolder {
  ucp_config_t* config = nullptr;
  ~ConfigHolder() {
    if (config) ucp_config_release(config);
  }
};

}  // namespace

std::unique_ptr<ProgressEngine> ProgressEngine::Create(const EngineOptions& opts,
                                                       ucs_status_t* status, std::string* what) {
  std::unique_ptr<ProgressEngine> engine(new ProgressEngine());
  engine->opts_ = opts;

  ConfigHolder cfg;
  *status = ucp_config_read(nullptr, nullptr, &cfg.config);
  if (*status != UCS_OK) {
    *what = "ucp_config_read failed";
    return nullptr;
  }
  if (!opts.transports.empty()) {
    *status = ucp_config_modify(cfg.config, "TLS", opts.transports.c_str());
    if (*status != UCS_OK) {
      *what = "invalid transport list '" + opts.transports + "'";
      return nullptr;
    }
  }
  if (!opts.net_devices.empty()) {
    *status = ucp_config_modify(cfg.config, "NET_DEVICES", opts.net_devices.c_str());
    if (*status != UCS_OK) {
      *what = "invalid net device list '" + opts.net_devices + "'";
      return nullptr;
    }
  }

  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Memory is registered from the JS thread while the progress thread drives
  // the worker, so the context must be thread safe.
  params.mt_workers_shared = 1;
  params.name = engine->opts_.name.c_str();
  *status = ucp_init(&params, cfg.config, &engine->context_);
  if (*status != UCS_OK) {
    *what = "ucp_init failed (transports '" + opts.transports + "', devices '" + opts.net_devices +
            "')";
    engine->context_ = nullptr;
    return nullptr;
  }

  engine->context_info_ = QueryContext(engine->context_);

  ucp_worker_params_t wparams;
  std::memset(&wparams, 0, sizeof(wparams));
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  wparams.name = engine->opts_.name.c_str();
  *status = ucp_worker_create(engine->context_, &wparams, &engine->worker_);
  if (*status != UCS_OK) {
    *what = "ucp_worker_create failed";
    engine->worker_ = nullptr;
    return nullptr;
  }

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  *status = ucp_worker_get_address(engine->worker_, &addr, &addr_len);
  if (*status != UCS_OK) {
    *what = "ucp_worker_get_address failed";
    return nullptr;
  }
  auto* bytes = reinterpret_cast<const uint8_t*>(addr);
  engine->worker_address_.assign(bytes, bytes + addr_len);
  ucp_worker_release_address(engine->worker_, addr);

  *status = ucp_worker_get_efd(engine->worker_, &engine->worker_fd_);
  if (*status != UCS_OK) {
    *what = "ucp_worker_get_efd failed";
    return nullptr;
  }

  ucp_am_handler_param_t am;
  std::memset(&am, 0, sizeof(am));
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = kNotifyAmId;
  am.cb = &ProgressEngine::OnAm;
  am.arg = engine.get();
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  *status = ucp_worker_set_am_recv_handler(engine->worker_, &am);
  if (*status != UCS_OK) {
    *what = "ucp_worker_set_am_recv_handler failed";
    return nullptr;
  }

  engine->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  engine->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (engine->wake_fd_ < 0 || engine->epoll_fd_ < 0) {
    *status = UCS_ERR_IO_ERROR;
    *what = std::string("eventfd/epoll_create1 failed: ") + std::strerror(errno);
    return nullptr;
  }
  for (int fd : {engine->worker_fd_, engine->wake_fd_}) {
    epoll_event ev;
    std::memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(engine->epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      *status = UCS_ERR_IO_ERROR;
      *what = std::string("epoll_ctl failed: ") + std::strerror(errno);
      return nullptr;
    }
  }
  *status = UCS_OK;
  return engine;
}

ProgressEngine::~ProgressEngine() {
  DestroyWorker();
  if (context_) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void ProgressEngine::DestroyWorker() {
  Shutdown();
  if (worker_ == nullptr) return;
  // UCX 1.13 segfaulted destroying a worker with requests outstanding (an abandoned endpoint's,
  // unflushed sends), so the worker used to be leaked then. UCX 1.22 purges them: 20 runs of
  // test/native/errors.test.ts (its abandon cases) under a 2-process CPU hog, 0 crashes. The
  // abandoned operations those requests point at are freed only after the destroy.
  for (ucp_rkey_h rkey : rkeys_) ucp_rkey_destroy(rkey);
  rkeys_.clear();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  abandoned_.clear();
}

void ProgressEngine::Start(std::function<void()> events_ready) {
  if (opts_.caller_progress) return;  // the caller progresses: no thread, no wake-ups
  events_ready_ = std::move(events_ready);
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

bool ProgressEngine::Progress() {
  if (stopped_.load() || worker_ == nullptr) return false;
  return Turn();
}

void ProgressEngine::Wake() {
  uint64_t one = 1;
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;  // EAGAIN means the counter is already non-zero: the loop is awake.
}

void ProgressEngine::RunAsync(std::function<void()> fn) {
  if (opts_.caller_progress) {
    // The caller's thread is the only one touching the worker.
    fn();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    commands_.push_back(std::move(fn));
  }
  // A polling loop finds the command by itself: a system call per command
  // would cost more than the put it carries. The loop sets sleeping_ before
  // its last look at commands_, so either it sees this command or we see it
  // sleeping (both are sequentially consistent).
  if (sleeping_.load()) Wake();
}

ucs_status_t ProgressEngine::RunSync(std::function<ucs_status_t()> fn) {
  if (!started_ || stopped_.load()) {
    // No progress thread: the caller's thread is the only one touching the worker.
    return fn();
  }
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    ucs_status_t status = UCS_OK;
  };
  auto state = std::make_shared<State>();
  RunAsync([state, fn = std::move(fn)] {
    ucs_status_t s = fn();
    std::lock_guard<std::mutex> lock(state->mu);
    state->status = s;
    state->done = true;
    state->cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_for(lock, kRunSyncDeadline, [&] { return state->done; })) {
    return UCS_ERR_TIMED_OUT;
  }
  return state->status;
}

void ProgressEngine::Accept(std::unique_ptr<TransferOp> owned) {
  owned->trace.started = MonoUs();
  uint64_t id = owned->id;
  TransferOp* p = owned.get();
  ops_[id] = std::move(owned);
  if (stopping_) {
    Complete(p, UCS_ERR_CANCELED);
  } else if (p->ep->failed.load()) {
    Complete(p, p->ep->fail_status);
  } else if (p->kind == OpKind::kNotify) {
    StartNotify(p);
  } else if (opts_.caller_progress && posting_.empty()) {
    // Posted inside the caller's own call: no queue, no hand-off.
    if (PostSome(p)) posting_.push_back(p);
  } else {
    posting_.push_back(p);
  }
}

void ProgressEngine::Submit(std::unique_ptr<TransferOp> op) {
  op->trace.submitted = MonoUs();
  if (opts_.caller_progress) {
    Accept(std::move(op));
    return;
  }
  TransferOp* raw = op.release();
  RunAsync([this, raw] { Accept(std::unique_ptr<TransferOp>(raw)); });
}

void ProgressEngine::SubmitMany(std::vector<std::unique_ptr<TransferOp>> ops) {
  const uint64_t now = MonoUs();
  for (auto& op : ops) op->trace.submitted = now;
  if (opts_.caller_progress) {
    for (auto& op : ops) Accept(std::move(op));
    return;
  }
  auto batch = std::make_shared<std::vector<std::unique_ptr<TransferOp>>>(std::move(ops));
  RunAsync([this, batch] {
    for (auto& op : *batch) Accept(std::move(op));
  });
}

void ProgressEngine::TakeEvents(std::vector<Event>* out) {
  std::lock_guard<std::mutex> lock(ev_mu_);
  out->swap(events_);
  events_.clear();
  events_signalled_ = false;
}

void ProgressEngine::PushEvent(Event ev) {
  bool signal = false;
  {
    std::lock_guard<std::mutex> lock(ev_mu_);
    events_.push_back(std::move(ev));
    if (!events_signalled_) {
      events_signalled_ = true;
      signal = true;
    }
  }
  // One wake-up per batch: the JS side takes everything queued so far.
  if (signal && events_ready_) events_ready_();
}

ucs_status_t ProgressEngine::CreateEndpoint(const std::vector<uint8_t>& address, bool peer_mode,
                                            std::shared_ptr<EndpointCore>* out) {
  auto core = std::make_shared<EndpointCore>();
  core->peer_error_mode = peer_mode;
  core->engine = this;
  ucs_status_t status = RunSync([this, core, &address, peer_mode] {
    if (stopping_) return UCS_ERR_CANCELED;
    ucp_ep_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    params.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = &ProgressEngine::OnEndpointError;
    params.err_handler.arg = core.get();
    ucs_status_t s = ucp_ep_create(worker_, &params, &core->ep);
    if (s != UCS_OK) {
      core->ep = nullptr;
      return s;
    }
    core->id = next_ep_id_++;
    endpoints_[core->id] = core;
    return UCS_OK;
  });
  if (status == UCS_OK) *out = core;
  return status;
}

void ProgressEngine::CloseEndpointNow(const std::shared_ptr<EndpointCore>& ep) {
  if (!ep->ep) return;
  if (ep->abandoned) {
    // A flush close would wait for the operations UCX never completes: leave it to the worker.
    ep->ep = nullptr;
    endpoints_.erase(ep->id);
    return;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &ProgressEngine::OnEpClosed;
  param.user_data = this;
  // FORCE is only valid in PEER error mode; a flush close is used otherwise.
  if (ep->peer_error_mode) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep->ep, &param);
  ep->ep = nullptr;
  endpoints_.erase(ep->id);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) ++closing_endpoints_;
}

void ProgressEngine::CloseEndpoint(std::shared_ptr<EndpointCore> ep) {
  RunAsync([this, ep] { CloseEndpointNow(ep); });
}

void ProgressEngine::AbandonEndpoint(std::shared_ptr<EndpointCore> ep, ucs_status_t status) {
  RunAsync([this, ep, status] {
    if (!ep->failed.load()) {
      ep->fail_status = status;
      ep->failed.store(true);
    }
    ep->abandoned = true;
    posting_.erase(std::remove_if(posting_.begin(), posting_.end(),
                                  [&](TransferOp* op) { return op->ep == ep; }),
                   posting_.end());
    for (auto it = ops_.begin(); it != ops_.end();) {
      if (it->second->ep != ep) {
        ++it;
        continue;
      }
      Event ev;
      ev.kind = it->second->prepared ? Event::Kind::kPrepared : Event::Kind::kCompletion;
      ev.owner = it->second->owner;
      ev.id = it->first;
      ev.status = status;
      // Still posting: no UCX request points at it (its puts/gets were freed unwatched), so it
      // can go now (a prepared one back to its owner). Flushing or notifying: UCX will call back
      // into it, so it stays (a prepared one is lost to its owner: the event carries no op).
      if (it->second->phase != TransferOp::Phase::kPosting) {
        it->second->abandoned = true;
        abandoned_.push_back(std::move(it->second));
      } else if (it->second->prepared) {
        ev.op = std::move(it->second);
      }
      PushEvent(std::move(ev));
      it = ops_.erase(it);
    }
  });
}

ucs_status_t ProgressEngine::UnpackRkey(const std::shared_ptr<EndpointCore>& ep,
                                        const std::vector<uint8_t>& packed, ucp_rkey_h* out) {
  return RunSync([this, ep, &packed, out] {
    if (!ep->ep) return UCS_ERR_NOT_CONNECTED;
    if (ep->failed.load()) return ep->fail_status;
    ucs_status_t s = ucp_ep_rkey_unpack(ep->ep, packed.data(), out);
    if (s == UCS_OK) rkeys_.insert(*out);
    return s;
  });
}

void ProgressEngine::DestroyRkey(ucp_rkey_h rkey) {
  auto destroy = [this, rkey] {
    if (rkeys_.erase(rkey) != 0) ucp_rkey_destroy(rkey);
  };
  if (started_ && !stopped_.load()) {
    RunAsync(destroy);
  } else {
    destroy();
  }
}

void ProgressEngine::RequestShutdown() {
  if (shutdown_requested_ || !started_ || stopped_.load()) return;
  shutdown_requested_ = true;
  RunAsync([this] {
    stopping_ = true;
    deadline_ = std::chrono::steady_clock::now() + kShutdownDeadline;
    // Transfers still posting have no UCX request pointing at them unless they
    // reached their flush: stop posting and let the flush report the outcome.
    for (TransferOp* op : posting_) {
      op->status = UCS_ERR_CANCELED;
      StartFlush(op);
    }
    posting_.clear();
  });
}

void ProgressEngine::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (opts_.caller_progress && worker_ != nullptr) {
    // No thread to stop: the same shutdown, driven here until it is done or its deadline passes.
    stopping_ = true;
    deadline_ = std::chrono::steady_clock::now() + kShutdownDeadline;
    for (TransferOp* op : posting_) {
      op->status = UCS_ERR_CANCELED;
      StartFlush(op);
    }
    posting_.clear();
    for (;;) {
      bool active = Turn();
      if (ShutdownDone()) {
        DrainWorker();
        break;
      }
      if (!active) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    stopped_.store(true);
    return;
  }
  if (!started_) return;
  RequestShutdown();
  thread_.join();
  stopped_.store(true);
}

bool ProgressEngine::DrainCommands() {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    if (commands_.empty()) return false;
    running_.swap(commands_);
  }
  for (auto& cmd : running_) cmd();
  running_.clear();  // keeps its capacity: no allocation per turn
  return true;
}

bool ProgressEngine::ShutdownDone() {
  if (!stopping_) return false;
  bool past_deadline = std::chrono::steady_clock::now() >= deadline_;
  if (!ops_.empty() && !past_deadline) return false;
  if (!endpoints_.empty()) {
    // Close endpoints once their operations are done (or abandoned).
    std::vector<std::shared_ptr<EndpointCore>> eps;
    for (auto& kv : endpoints_) eps.push_back(kv.second);
    for (auto& ep : eps) CloseEndpointNow(ep);
    return false;
  }
  if (closing_endpoints_ > 0 && !past_deadline) return false;
  // Past the deadline: report what is left as cancelled and keep the objects
  // alive until the worker is destroyed.
  for (auto& kv : ops_) {
    Event ev;
    ev.kind = kv.second->prepared ? Event::Kind::kPrepared : Event::Kind::kCompletion;
    ev.owner = kv.second->owner;
    ev.id = kv.first;
    ev.status = UCS_ERR_CANCELED;
    PushEvent(std::move(ev));
    abandoned_.push_back(std::move(kv.second));
  }
  ops_.clear();
  return true;
}

bool ProgressEngine::Turn() {
  bool active = DrainCommands();
  size_t n = posting_.size();
  active = active || n > 0;
  for (size_t i = 0; i < n; ++i) {
    TransferOp* op = posting_.front();
    posting_.pop_front();
    if (PostSome(op)) posting_.push_back(op);
  }
  // Progress until idle, bounded so that commands are not starved.
  for (int i = 0; i < 1024 && ucp_worker_progress(worker_) != 0; ++i) active = true;
  return active;
}

void ProgressEngine::Loop() {
  epoll_event evs[2];
  auto last_activity = std::chrono::steady_clock::now();
  for (;;) {
    bool active = Turn();
    if (ShutdownDone()) {
      DrainWorker();
      break;
    }
    // While a transfer is in flight, keep polling: UCX's shared-memory
    // protocols move large puts and gets (CMA) in fragments driven by
    // ucp_worker_progress, and a fragment that could not be sent at once
    // raises no event on the worker's fd. Sleeping there stalled each such
    // transfer until the sleep bound (measured here: a 16 MiB WRITE of host
    // memory took 142 ms sleeping, 8 ms polling).
    if (!posting_.empty() || opts_.busy_poll || stopping_) continue;
    if (!ops_.empty()) {
      // Polling for a transfer in flight, not for new work: let a runnable
      // thread (the JS thread posting the next transfer, on a busy machine)
      // have the core first.
      if (!active) sched_yield();
      continue;
    }
    // Keep polling briefly after activity: the answer to what was just sent
    // usually comes within this window, and waking a sleeping thread costs
    // milliseconds on a VM (measured here: KV-ready p50 13 ms sleeping, 3 ms
    // spinning, for a one-transfer-at-a-time push).
    auto now = std::chrono::steady_clock::now();
    if (active) last_activity = now;
    if (now - last_activity < opts_.spin_after_activity) {
      // Spinning must not keep a runnable thread off this core: the JavaScript thread that the
      // answer just woke (measured here: with both sidecars' progress threads spinning on two
      // cores, D's XferDone waited 190 us between its progress thread and its JavaScript).
      if (!active) sched_yield();
      continue;
    }
    sleeping_.store(true);
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      if (!commands_.empty()) {
        sleeping_.store(false);
        continue;
      }
    }
    ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY) {
      sleeping_.store(false);
      continue;
    }
    int n_ready = epoll_wait(epoll_fd_, evs, 2, kSleepBoundMs);
    sleeping_.store(false);
    (void)n_ready;
    uint64_t counter;
    ssize_t r = read(wake_fd_, &counter, sizeof(counter));
    (void)r;
  }
}

void ProgressEngine::DrainWorker() {
  // Closing an endpoint leaves UCX work on the worker's callback queue (the local disconnect of
  // the flush close, the peer's EP_REMOVED) that completes only on later progress calls; a worker
  // destroyed before that work ran aborts on an assertion in Debian's UCX (seen here about one
  // close in three with two agents in one process). Progress until the worker has been idle for
  // a few consecutive calls, within a bound.
  const auto until = std::chrono::steady_clock::now() + kDrainBound;
  int idle = 0;
  while (idle < kDrainIdleCalls && std::chrono::steady_clock::now() < until) {
    if (ucp_worker_progress(worker_) != 0) {
      idle = 0;
    } else {
      ++idle;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  // Sends UCX queued by itself may still be pending towards a peer that no longer drains them.
  // A worker flush, bounded, gives them a chance; what is still pending after it is purged by
  // ucp_worker_destroy (the flush request is released then too).
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t req = ucp_worker_flush_nbx(worker_, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const auto flush_until = std::chrono::steady_clock::now() + kDrainBound;
  while (ucp_request_check_status(req) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < flush_until) {
    if (ucp_worker_progress(worker_) == 0)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ucp_request_free(req);
}

bool ProgressEngine::PostSome(TransferOp* op) {
  EndpointCore* ep = op->ep.get();
  if (ep->failed.load() || ep->ep == nullptr) {
    op->status = ep->failed.load() ? ep->fail_status : UCS_ERR_NOT_CONNECTED;
    Complete(op, op->status);
    return false;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  const size_t count = op->desc.size() / 3;
  const size_t end = std::min(count, op->next + kPostChunk);
  const uint64_t* d = op->desc.data();
  uint64_t posted_bytes = 0;
  if (op->next == 0) op->trace.first_post = MonoUs();
  for (; op->next < end && posted_bytes < kPostChunkBytes; ++op->next) {
    while (op->next >= op->segs[op->seg].end) ++op->seg;  // segments are never empty
    const TransferOp::Segment& sg = op->segs[op->seg];
    if (sg.local_memh != nullptr) {
      param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      param.memh = sg.local_memh;
    } else {
      param.op_attr_mask = 0;
    }
    const uint64_t local = d[3 * op->next];
    const uint64_t remote = d[3 * op->next + 1];
    const uint64_t length = d[3 * op->next + 2];
    posted_bytes += length;
    ucs_status_ptr_t req = op->kind == OpKind::kWrite
                               ? ucp_put_nbx(ep->ep, sg.local_base + local, length,
                                             sg.remote_base + remote, sg.rkey, &param)
                               : ucp_get_nbx(ep->ep, sg.local_base + local, length,
                                             sg.remote_base + remote, sg.rkey, &param);
    if (UCS_PTR_IS_ERR(req)) {
      op->status = UCS_PTR_STATUS(req);
      break;
    }
    // No callback: completion of every put/get is observed through the flush.
    if (req != nullptr) ucp_request_free(req);
  }
  if (op->status != UCS_OK || op->next == count) {
    op->trace.posted = MonoUs();
    StartFlush(op);
    return false;
  }
  return true;
}

void ProgressEngine::StartFlush(TransferOp* op) {
  op->phase = TransferOp::Phase::kFlushing;
  EndpointCore* ep = op->ep.get();
  if (ep->ep == nullptr) {
    Complete(op, op->status != UCS_OK ? op->status : UCS_ERR_NOT_CONNECTED);
    return;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &ProgressEngine::OnFlush;
  param.user_data = op;
  ucs_status_ptr_t req = ucp_ep_flush_nbx(ep->ep, &param);
  if (req == nullptr) {
    AfterFlush(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    AfterFlush(op, UCS_PTR_STATUS(req));
  }
}

void ProgressEngine::OnFlush(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<TransferOp*>(user_data);
  ucp_request_free(request);
  op->ep->engine->AfterFlush(op, status);
}

void ProgressEngine::AfterFlush(TransferOp* op, ucs_status_t status) {
  op->trace.flushed = MonoUs();
  if (op->abandoned) {
    Complete(op, status);  // no notification for a transfer JavaScript saw fail
    return;
  }
  if (op->status == UCS_OK && status != UCS_OK) op->status = status;
  if (op->status == UCS_OK && op->has_notification && !stopping_) {
    StartNotify(op);
  } else {
    Complete(op, op->status);
  }
}

void ProgressEngine::StartNotify(TransferOp* op) {
  op->phase = TransferOp::Phase::kNotifying;
  EndpointCore* ep = op->ep.get();
  if (ep->ep == nullptr || ep->failed.load()) {
    Complete(op, ep->failed.load() ? ep->fail_status : UCS_ERR_NOT_CONNECTED);
    return;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &ProgressEngine::OnNotifySent;
  param.user_data = op;
  // Eager only: the receiver's handler then always holds the whole message.
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t req = ucp_am_send_nbx(ep->ep, kNotifyAmId, opts_.name.data(), opts_.name.size(),
                                         op->notification.data(), op->notification.size(), &param);
  if (req == nullptr) {
    op->trace.notified = MonoUs();
    Complete(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    Complete(op, UCS_PTR_STATUS(req));
  }
}

void ProgressEngine::OnNotifySent(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<TransferOp*>(user_data);
  ucp_request_free(request);
  op->trace.notified = MonoUs();
  op->ep->engine->Complete(op, status);
}

void ProgressEngine::Complete(TransferOp* op, ucs_status_t status) {
  if (op->abandoned) {
    // UCX finished an operation JavaScript already saw fail: just let it go now.
    abandoned_.erase(
        std::remove_if(abandoned_.begin(), abandoned_.end(),
                       [op](const std::unique_ptr<TransferOp>& p) { return p.get() == op; }),
        abandoned_.end());
    return;
  }
  Event ev;
  ev.kind = Event::Kind::kCompletion;
  ev.id = op->id;
  ev.status = status;
  ev.trace = op->trace;
  ev.trace.completed = MonoUs();
  if (op->prepared) {
    // Back to its owner, to be posted again: the event carries it.
    auto it = ops_.find(op->id);
    ev.kind = Event::Kind::kPrepared;
    ev.owner = op->owner;
    ev.op = std::move(it->second);
    ops_.erase(it);
    PushEvent(std::move(ev));
    return;
  }
  ops_.erase(op->id);  // destroys op
  PushEvent(std::move(ev));
}

void ProgressEngine::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* core = static_cast<EndpointCore*>(arg);
  core->fail_status = status;
  core->failed.store(true);
  Event ev;
  ev.kind = Event::Kind::kEndpointFailed;
  ev.id = core->id;
  ev.status = status;
  core->engine->PushEvent(std::move(ev));
}

void ProgressEngine::OnEpClosed(void* request, ucs_status_t status, void* user_data) {
  auto* engine = static_cast<ProgressEngine*>(user_data);
  ucp_request_free(request);
  --engine->closing_endpoints_;
}

ucs_status_t ProgressEngine::OnAm(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* engine = static_cast<ProgressEngine*>(arg);
  Event ev;
  ev.received_us = MonoUs();
  ev.peer.assign(static_cast<const char*>(header), std::min<size_t>(header_length, 256));
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ||
      length > engine->opts_.max_notification_bytes || header_length > 256) {
    // Senders use eager only and respect the cap: this did not come from a
    // well-behaved kvxfer. It is released unread, and reported.
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      ucp_am_data_release(engine->worker_, data);
    }
    ev.kind = Event::Kind::kDropped;
    ev.id = length;
    engine->PushEvent(std::move(ev));
    return UCS_OK;
  }
  ev.kind = Event::Kind::kNotification;
  auto* bytes = static_cast<const uint8_t*>(data);
  ev.bytes.assign(bytes, bytes + length);
  engine->PushEvent(std::move(ev));
  return UCS_OK;
}

}  // namespace kvxfer
