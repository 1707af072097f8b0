// The progress engine: one UCX context and worker, and the one thread that
// owns the worker. Nothing in this file touches N-API; the addon copies every
// JavaScript input into the plain structs of operation.h before work leaves the
// JS thread, and builds JavaScript results from Events back on the JS thread.
// progress.cc: creation, commands and the loop; progress_ops.cc: an operation's
// steps; progress_endpoints.cc: endpoints and remote keys; progress_shutdown.cc.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "memory_type.h"
#include "operation.h"

namespace kvxfer {

// Active-message id used for notifications.
constexpr uint16_t kNotifyAmId = 0x4b58;  // "KX"

struct EngineOptions {
  std::string name;
  std::string transports;   // UCX_TLS-style list; empty = UCX default
  std::string net_devices;  // UCX_NET_DEVICES-style list; empty = UCX default
  bool busy_poll = false;
  // No progress thread: the caller's (JavaScript) thread posts each operation inside the call
  // that submits it and progresses the worker itself (Progress()), as NIXL's Python loop does.
  // For latency-critical callers that poll; nothing moves between their Progress() calls.
  bool caller_progress = false;
  // After any activity, poll this long before sleeping on the event fd.
  std::chrono::microseconds spin_after_activity{0};
  // With a progress thread: a small operation submitted while the thread is not inside the worker
  // (and nothing is queued before it) is posted, progressed and, if it completes at once,
  // completed on the submitting thread, under the worker's lock: no hand-off, no wake-up.
  bool inline_post = true;
  // With a progress thread: the JavaScript thread also watches the worker's event fd (loop_fd)
  // and, when it fires, progresses the worker itself under the lock and delivers what arrived,
  // without waiting for the progress thread to wake and hand it over (LoopTurn). Off by default
  // (docs/native.md says why).
  bool loop_wake = false;
  size_t max_notification_bytes = 4 << 20;
  // TCP transports: a connection whose sent bytes stay unacknowledged this long is given up by
  // the kernel (TCP_USER_TIMEOUT, as UCX_TCP_USER_TIMEOUT), so a connection cut by a partition
  // fails instead of resuming at TCP's next backed-off retransmission after the heal. 0 = UCX's
  // default; UCX_TCP_USER_TIMEOUT in the environment wins.
  uint64_t tcp_user_timeout_ms = 0;
};

class ProgressEngine {
 public:
  // Creates the context and worker on the calling thread. On failure returns
  // nullptr and fills *status and *what.
  static std::unique_ptr<ProgressEngine> Create(const EngineOptions& opts, ucs_status_t* status,
                                                std::string* what);
  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  // Starts the progress thread. `events_ready` is called from the progress
  // thread when the first event of a new batch is queued; the JS side then
  // calls TakeEvents() and re-arms by returning.
  void Start(std::function<void()> events_ready);

  ucp_context_h context() const { return context_; }
  // The transports this agent's context opened and the memory types it serves (read at Create).
  const ContextInfo& context_info() const { return context_info_; }
  const std::vector<uint8_t>& worker_address() const { return worker_address_; }
  const std::string& name() const { return opts_.name; }
  size_t max_notification_bytes() const { return opts_.max_notification_bytes; }

  // Runs `fn` on the progress thread and waits for it (bounded). Used for the
  // cheap, local worker calls: endpoint creation, rkey unpacking.
  [[nodiscard]] ucs_status_t RunSync(std::function<ucs_status_t()> fn);
  // Runs `fn` on the progress thread without waiting.
  void RunAsync(std::function<void()> fn);

  void Submit(std::unique_ptr<TransferOp> op);
  // Several operations handed over together: one command, one wake-up of the progress thread.
  void SubmitMany(std::vector<std::unique_ptr<TransferOp>> ops);
  bool caller_progress() const { return opts_.caller_progress; }
  // Operations the submitting thread posted itself so far (TryInline).
  uint64_t inline_posts() const { return inline_posts_; }
  // Turns in which the event loop progressed the worker itself (LoopTurn).
  uint64_t loop_turns() const { return loop_turns_; }
  // Caller-progress mode: posts what is queued and progresses the worker until it is idle
  // (bounded), on the calling thread. Returns whether anything happened.
  bool Progress();
  void TakeEvents(std::vector<Event>* out);
  bool events_pending();

  // The event loop's watch on the worker (loop_wake; -1 otherwise): an epoll fd holding the
  // worker's event fd once (EPOLLONESHOT), readable when the worker has something to progress.
  int loop_fd() const { return loop_fd_; }
  // Called on the JavaScript thread when loop_fd() is readable: takes the worker's lock if the
  // progress thread is not inside the worker, progresses it until idle and re-arms it, the events
  // it produced left queued for the caller to deliver at once (no wake-up of JavaScript); a turn
  // that leaves transfers in flight wakes the progress thread to poll them. Without the worker
  // (the thread has it) it does nothing. The watch then stays off until the turn (idle,
  // armed, with something for JavaScript) or the thread (going to sleep after handing JavaScript
  // an event, loop_useful_) turns it back on.
  void LoopTurn();

  // Creates an endpoint (progress thread) from a raw UCX worker address.
  [[nodiscard]] ucs_status_t CreateEndpoint(const std::vector<uint8_t>& address, bool peer_mode,
                                            std::shared_ptr<EndpointCore>* out);
  // Closes an endpoint in the background; FORCE in peer mode, flush otherwise.
  void CloseEndpoint(std::shared_ptr<EndpointCore> ep);
  // Fails every operation on `ep` now with `status` (settled for JavaScript) and marks the
  // endpoint failed: for a peer known dead whose operations UCX never completes.
  // With `settle_seq` != 0 it then flushes the endpoint and reports kEndpointSettled (that seq)
  // once UCX holds none of the abandoned operations: until then their bytes may still land (an
  // abandoned operation is not cancelled; over TCP it waits in the old connection for the link).
  void AbandonEndpoint(std::shared_ptr<EndpointCore> ep, ucs_status_t status,
                       uint64_t settle_seq = 0);
  // Flushes `ep` and reports kEndpointSettled with `seq` once every operation posted on it before
  // is over in UCX (at once for an endpoint already closed).
  void SettleEndpoint(std::shared_ptr<EndpointCore> ep, uint64_t seq);
  // Unpacks a peer's packed remote key for `ep` (progress thread). The engine
  // owns the result until DestroyRkey(), or until it is destroyed itself.
  [[nodiscard]] ucs_status_t UnpackRkey(const std::shared_ptr<EndpointCore>& ep,
                                        const std::vector<uint8_t>& packed, ucp_rkey_h* out);
  void DestroyRkey(ucp_rkey_h rkey);

  // Fails every queued transfer, closes endpoints within a deadline, stops
  // and joins the thread. Idempotent. Completions for failed transfers are
  // left in the event queue for the caller to deliver.
  void Shutdown();
  // Starts Shutdown() without waiting: the deadline starts now. Several engines closed together
  // (a sidecar's ranks) then wait out one deadline, not one each. Idempotent.
  void RequestShutdown();
  bool shutdown_requested() const { return shutdown_requested_; }
  // Stops the thread and destroys the worker (which purges its pending requests): call it before
  // the regions' memory is unmapped, since a pending request may still point at a region's
  // memory handle (UCX re-registers it while purging; measured on 1.13: a segfault in
  // ucp_mem_rereg_mds when the regions went first). Idempotent; the destructor calls it.
  void DestroyWorker();

 private:
  ProgressEngine() = default;
  // progress.cc
  void Loop();
  // One turn of the loop: commands, posting, worker progress. Returns whether anything happened.
  bool Turn();
  void Wake();
  // Enables the event loop's one-shot watch on the worker's fd (EPOLL_CTL_ADD or _MOD), or
  // disables it (`on` false).
  int WatchLoop(int op, bool on = true);
  // Under worker_mu_, with transfers left in flight: the thread polls them, so the event loop's
  // watch goes off until the thread next sleeps (no wake-up of JavaScript for their answers).
  void QuietLoop();
  bool DrainCommands();  // true when there were any
  // Takes the operations over on the calling (JavaScript) thread if the worker's lock is free and
  // no command waits before them; false (nothing taken) otherwise.
  bool TryInline(std::unique_ptr<TransferOp>* ops, size_t count);
  static bool InlineEligible(const TransferOp& op);
  void PushEvent(Event ev);

  // progress_ops.cc
  // Takes an operation over on the progress thread (or the caller's, in caller-progress mode or
  // inline: `post_here`, the caller posts it now when nothing is being posted before it).
  void Accept(std::unique_ptr<TransferOp> owned, bool post_here = false);
  bool PostSome(TransferOp* op);  // returns true while descriptors remain
  void StartFlush(TransferOp* op);
  void AfterFlush(TransferOp* op, ucs_status_t status);
  void StartNotify(TransferOp* op);
  void Complete(TransferOp* op, ucs_status_t status);
  static void OnFlush(void* request, ucs_status_t status, void* user_data);
  // ucp_ep_flush_nbx with a send callback: the request, nullptr (done now) or an error pointer.
  static ucs_status_ptr_t FlushWith(ucp_ep_h ep, ucp_send_nbx_callback_t cb, void* user_data);
  static void OnNotifySent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);

  // progress_endpoints.cc
  void CloseEndpointNow(const std::shared_ptr<EndpointCore>& ep);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnEpClosed(void* request, ucs_status_t status, void* user_data);
  void FlushToSettle(const std::shared_ptr<EndpointCore>& ep, uint64_t seq);
  void PushSettled(uint64_t ep_id, uint64_t seq, ucs_status_t status);
  static void OnSettleFlushed(void* request, ucs_status_t status, void* user_data);

  // progress_shutdown.cc
  bool ShutdownDone();
  void DrainWorker();

  EngineOptions opts_;
  ucp_context_h context_ = nullptr;
  ContextInfo context_info_;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  int loop_fd_ = -1;
  // Set while the loop's watch is (or may be) off: the progress thread re-enables it before it
  // sleeps, if loop_useful_.
  std::atomic<bool> loop_watch_off_{false};
  // Set when the thread handed JavaScript an event since the watch last went back on: the watch
  // is worth having (a passive TCP target's puts give JavaScript nothing, and would only wake it).
  std::atomic<bool> loop_useful_{false};
  // Whether the current LoopTurn queued any event (under ev_mu_).
  bool loop_turn_pushed_ = false;
  // Set (under worker_mu_) while the JavaScript thread progresses the worker in LoopTurn: the
  // events it produces are delivered after the turn, not signalled through events_ready.
  bool loop_turn_ = false;
  uint64_t loop_turns_ = 0;  // JS thread
  std::vector<uint8_t> worker_address_;

  std::thread thread_;
  bool started_ = false;
  bool shut_down_ = false;            // JS thread
  bool shutdown_requested_ = false;   // JS thread
  std::atomic<bool> stopped_{false};  // set once the thread has been joined

  // Held by whichever thread touches the worker and the "progress-thread only" state below: the
  // progress thread for each turn and its arming, the JavaScript thread for an inline post
  // (TryInline). The worker is created UCS_THREAD_MODE_SERIALIZED accordingly.
  std::mutex worker_mu_;
  uint64_t inline_posts_ = 0;  // JS thread
  // Set by an inline post: the progress thread counts it as activity (its spin after activity
  // starts again, so it is awake when the answer to what was just sent comes).
  std::atomic<bool> inline_activity_{false};
  // Set while the JavaScript thread tries for worker_mu_ to post inline: the progress thread
  // stays out of the worker meanwhile (its turns are short then, but it retakes the lock at once).
  std::atomic<bool> inline_wanted_{false};

  std::mutex cmd_mu_;
  std::vector<std::function<void()>> commands_;
  // Set by the progress thread while it sleeps (or is about to) in
  // epoll_wait: only then does a new command need the eventfd written.
  std::atomic<bool> sleeping_{false};
  // Progress-thread only: the commands being run, kept to reuse its storage.
  std::vector<std::function<void()>> running_;

  std::mutex ev_mu_;
  std::vector<Event> events_;
  bool events_signalled_ = false;
  std::function<void()> events_ready_;

  // Progress-thread only (with a thread: whoever holds worker_mu_).
  std::unordered_map<uint64_t, std::unique_ptr<TransferOp>> ops_;
  std::deque<TransferOp*> posting_;
  std::unordered_map<uint64_t, std::shared_ptr<EndpointCore>> endpoints_;
  size_t closing_endpoints_ = 0;
  uint64_t next_ep_id_ = 1;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point deadline_;
  std::unordered_set<ucp_rkey_h> rkeys_;
  std::vector<std::unique_ptr<TransferOp>> abandoned_;
};

}  // namespace kvxfer
