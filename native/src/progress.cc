#include "progress.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>

#include "ucx_fix.h"

namespace kvxfer {

namespace {

// A sleeping loop wakes at least this often, so a missed wake-up costs
// latency, never a hang.
constexpr int kSleepBoundMs = 100;

// How long RunSync() waits for the progress thread.
constexpr auto kRunSyncDeadline = std::chrono::seconds(30);

// An operation the JavaScript thread may post itself (TryInline): one posting chunk at most, and
// few enough bytes that a synchronous shared-memory copy of them stalls the event loop for
// microseconds, not milliseconds.
constexpr size_t kInlineDescriptors = 64;
constexpr uint64_t kInlineBytes = 256 << 10;
// Worker progress calls after an inline post, to complete its flush and notification at once.
constexpr int kInlineProgressCalls = 16;
// Tries for the worker's lock before an operation goes the usual way (a few microseconds: about
// one idle turn of a polling progress thread, which stays out meanwhile).
constexpr int kInlineLockTries = 256;
// Worker progress calls in one turn of the event loop's own (LoopTurn) before what remains goes to
// the progress thread.
constexpr int kLoopProgressCalls = 64;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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

  if (opts.tcp_user_timeout_ms > 0 && std::getenv("UCX_TCP_USER_TIMEOUT") == nullptr) {
    const std::string value = std::to_string(opts.tcp_user_timeout_ms) + "ms";
    *status = ucp_config_modify(cfg.config, "TCP_USER_TIMEOUT", value.c_str());
    if (*status != UCS_OK) {
      *what = "cannot set UCX's TCP_USER_TIMEOUT to " + value;
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
  // One thread at a time, not always the same one: the progress thread, or the JavaScript thread
  // posting inline, each under worker_mu_ (caller progress: the JavaScript thread alone).
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  wparams.name = engine->opts_.name.c_str();
  InstallUcxGetReplyFix();
  *status = ucp_worker_create(engine->context_, &wparams, &engine->worker_);
  if (*status != UCS_OK) {
    *what = "ucp_worker_create failed";
    engine->worker_ = nullptr;
    return nullptr;
  }
  CheckUcxGetReplyFix(engine->worker_);

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
  if (opts.loop_wake && !opts.caller_progress) {
    engine->loop_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (engine->loop_fd_ < 0 || engine->WatchLoop(EPOLL_CTL_ADD) != 0) {
      *status = UCS_ERR_IO_ERROR;
      *what = std::string("epoll_create1/epoll_ctl failed: ") + std::strerror(errno);
      return nullptr;
    }
  }
  *status = UCS_OK;
  return engine;
}

int ProgressEngine::WatchLoop(int op, bool on) {
  epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = on ? EPOLLIN | EPOLLONESHOT : 0;
  ev.data.fd = worker_fd_;
  return epoll_ctl(loop_fd_, op, worker_fd_, &ev);
}

void ProgressEngine::QuietLoop() {
  if (loop_fd_ >= 0 && !loop_watch_off_.exchange(true)) (void)WatchLoop(EPOLL_CTL_MOD, false);
}

ProgressEngine::~ProgressEngine() {
  DestroyWorker();
  if (context_) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (loop_fd_ >= 0) close(loop_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
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

bool ProgressEngine::InlineEligible(const TransferOp& op) {
  if (op.kind == OpKind::kNotify) return op.notification.size() <= kInlineBytes;
  const size_t count = op.desc.size() / 3;
  if (count > kInlineDescriptors) return false;
  uint64_t bytes = 0;
  for (size_t i = 0; i < count; ++i) bytes += op.desc[3 * i + 2];
  return bytes <= kInlineBytes;
}

bool ProgressEngine::TryInline(std::unique_ptr<TransferOp>* ops, size_t count) {
  if (!opts_.inline_post || !started_ || shutdown_requested_) return false;
  for (size_t i = 0; i < count; ++i) {
    if (!InlineEligible(*ops[i])) return false;
  }
  std::unique_lock<std::mutex> lock(worker_mu_, std::defer_lock);
  inline_wanted_.store(true);
  for (int i = 0; i < kInlineLockTries && !lock.try_lock(); ++i) CpuRelax();
  inline_wanted_.store(false);
  // A transfer still being posted in chunks: a new one would only queue behind it (the thread's).
  if (!lock.owns_lock() || stopping_ || !posting_.empty()) return false;
  {
    // A command queued earlier (an endpoint closed or abandoned, an earlier transfer) goes first:
    // an inline post must not overtake it.
    std::lock_guard<std::mutex> cmds(cmd_mu_);
    if (!commands_.empty()) return false;
  }
  inline_posts_ += count;
  for (size_t i = 0; i < count; ++i) Accept(std::move(ops[i]), /*post_here=*/true);
  for (int i = 0; i < kInlineProgressCalls && ucp_worker_progress(worker_) != 0; ++i) {
  }
  const bool in_flight = !ops_.empty() || !posting_.empty();
  // Left in flight: the thread polls them from now on, and their answers are its, not the event
  // loop's (waking the loop for them cost TCP writes a fifth of their rate).
  if (in_flight) QuietLoop();
  const bool spins = opts_.spin_after_activity.count() > 0;
  if (spins) inline_activity_.store(true);
  lock.unlock();
  // What did not complete here is the progress thread's now. It decides whether to sleep under
  // worker_mu_ and marks sleeping_ before it lets go, so either it saw these operations or it is
  // marked asleep here and gets woken. A thread that spins after activity is woken too, so that
  // it polls for the answer to what was just sent, as it would had it posted it.
  if ((in_flight || spins) && sleeping_.load()) Wake();
  return true;
}

void ProgressEngine::Submit(std::unique_ptr<TransferOp> op) {
  op->trace.submitted = Stamp(*op);
  if (opts_.caller_progress) {
    Accept(std::move(op));
    return;
  }
  if (TryInline(&op, 1)) return;
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
  if (TryInline(ops.data(), ops.size())) return;
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

bool ProgressEngine::events_pending() {
  std::lock_guard<std::mutex> lock(ev_mu_);
  return !events_.empty();
}

void ProgressEngine::LoopTurn() {
  // Take the readiness (the watch is one-shot).
  epoll_event ev;
  (void)epoll_wait(loop_fd_, &ev, 1, 0);
  // Off until re-enabled below, or by the progress thread when it next goes to sleep.
  loop_watch_off_.store(true);
  if (!started_ || stopped_.load() || shutdown_requested_) return;
  std::unique_lock<std::mutex> lock(worker_mu_, std::defer_lock);
  inline_wanted_.store(true);
  for (int i = 0; i < kInlineLockTries && !lock.try_lock(); ++i) CpuRelax();
  inline_wanted_.store(false);
  // The thread is inside the worker, or polls transfers in flight (it does not sleep meanwhile):
  // what fired is its to progress, and the loop keeps out of its way (the watch stays off) until
  // the thread sleeps again.
  if (!lock.owns_lock() || stopping_ || !ops_.empty() || !posting_.empty()) return;
  ++loop_turns_;
  loop_turn_ = true;
  // A few progress calls: what woke the loop (a notification, an answer, a completion). Arming
  // answers busy while the worker still has events (nearly always right after a receive): progress
  // and arm again, as the thread does, within the same bound. Work that keeps coming (a peer's
  // large read served over TCP) is left to the thread, so that the event loop is not held for it.
  int calls = 0;
  bool armed = false;
  while (!armed && calls < kLoopProgressCalls) {
    while (calls < kLoopProgressCalls && ucp_worker_progress(worker_) != 0) ++calls;
    if (calls < kLoopProgressCalls) armed = ucp_worker_arm(worker_) == UCS_OK;
    ++calls;
  }
  loop_turn_ = false;
  const bool in_flight = !ops_.empty() || !posting_.empty();
  const bool delivered = loop_turn_pushed_;
  loop_turn_pushed_ = false;
  if (armed && !in_flight && delivered) {
    // Idle and armed, and the turn was worth it: the next event fires the watch again. A turn
    // that found nothing for JavaScript (a peer's TCP put, which only the worker sees) leaves it
    // off until an event for JavaScript comes through the thread (loop_useful_).
    loop_watch_off_.store(false);
    (void)WatchLoop(EPOLL_CTL_MOD);
  }
  lock.unlock();
  // Transfers in flight need polling (a CMA fragment raises no event), work still coming needs
  // progress: the thread's.
  if ((in_flight || !armed) && sleeping_.load()) Wake();
}

void ProgressEngine::PushEvent(Event ev) {
  bool signal = false;
  {
    std::lock_guard<std::mutex> lock(ev_mu_);
    events_.push_back(std::move(ev));
    if (loop_turn_) loop_turn_pushed_ = true;
    if (!events_signalled_ && !loop_turn_) {
      events_signalled_ = true;
      signal = true;
    }
  }
  // One wake-up per batch: the JS side takes everything queued so far.
  if (signal && events_ready_) events_ready_();
  // The worker's events lead to JavaScript: worth the event loop's own watch (LoopTurn).
  if (signal && loop_fd_ >= 0) loop_useful_.store(true);
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
    if (inline_wanted_.load()) {
      // The JavaScript thread is about to post inline: let it have the worker (a few µs at most).
      sched_yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(worker_mu_);
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
    if (!posting_.empty() || !ops_.empty()) QuietLoop();  // the thread polls: the loop keeps out
    if (!posting_.empty() || opts_.busy_poll || stopping_) continue;
    if (!ops_.empty()) {
      lock.unlock();
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
    if (inline_activity_.exchange(false)) active = true;
    if (active) last_activity = now;
    if (now - last_activity < opts_.spin_after_activity) {
      lock.unlock();
      // Spinning must not keep a runnable thread off this core: the JavaScript thread that the
      // answer just woke (measured here: with both sidecars' progress threads spinning on two
      // cores, D's XferDone waited 190 us between its progress thread and its JavaScript).
      if (!active) sched_yield();
      continue;
    }
    // Decided under worker_mu_: an inline post (TryInline) that leaves work in flight after this
    // point sees sleeping_ and wakes the thread.
    sleeping_.store(true);
    {
      std::lock_guard<std::mutex> cmds(cmd_mu_);
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
    // Armed: the event loop may watch the worker again (a LoopTurn that found the worker taken
    // left its watch off).
    if (loop_fd_ >= 0 && loop_watch_off_.load() && loop_useful_.exchange(false)) {
      loop_watch_off_.store(false);
      (void)WatchLoop(EPOLL_CTL_MOD);
    }
    lock.unlock();
    int n_ready = epoll_wait(epoll_fd_, evs, 2, kSleepBoundMs);
    sleeping_.store(false);
    (void)n_ready;
    uint64_t counter;
    ssize_t r = read(wake_fd_, &counter, sizeof(counter));
    (void)r;
  }
}

}  // namespace kvxfer
