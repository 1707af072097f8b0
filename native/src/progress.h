// The progress engine: one UCX context and worker, and the one thread that
// owns the worker. Nothing in this file touches N-API; the addon copies every
// JavaScript input into the plain structs below before work leaves the JS
// thread, and builds JavaScript results from Events back on the JS thread.
#pragma once

#include <time.h>
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

namespace kvxfer {

// Active-message id used for notifications.
constexpr uint16_t kNotifyAmId = 0x4b58;  // "KX"

enum class OpKind { kWrite, kRead, kNotify };

// Microseconds of CLOCK_MONOTONIC: Node's process.hrtime reads the same clock, so native and
// JavaScript timestamps taken on one host compare, across processes too.
inline uint64_t MonoUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

// When an operation passed each step (MonoUs; 0: not reached). Written by the JS thread
// (submitted) before the hand-off, by the progress thread after it.
struct OpTrace {
  uint64_t submitted = 0;   // handed to the progress thread
  uint64_t started = 0;     // the progress thread took it
  uint64_t first_post = 0;  // first put/get posted
  uint64_t posted = 0;      // last put/get posted
  uint64_t flushed = 0;     // the flush completed: every byte remotely complete
  uint64_t notified = 0;    // the notification's send completed
  uint64_t completed = 0;   // the completion was queued for JavaScript
};

// One UCX endpoint. Touched by the progress thread only, except `failed`,
// which the JS thread may read.
struct EndpointCore {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  bool peer_error_mode = false;
  std::atomic<bool> failed{false};
  ucs_status_t fail_status = UCS_OK;
  // Given up on (AbandonEndpoint): never closed through UCX, whose close would wait on it forever.
  bool abandoned = false;
  class ProgressEngine* engine = nullptr;
};

// A transfer as the progress thread sees it: everything copied out of
// JavaScript already, bounds already checked.
struct TransferOp {
  uint64_t id = 0;
  // A prepared transfer (Agent.prepare): posted again and again; on completion it goes back to its
  // owner through the event queue instead of being destroyed. `owner` is opaque to the engine.
  bool prepared = false;
  void* owner = nullptr;
  // Settled for JavaScript by AbandonEndpoint while UCX may still call back into it: kept in
  // ProgressEngine::abandoned_ until UCX does (or for good).
  bool abandoned = false;
  OpKind kind = OpKind::kWrite;
  std::shared_ptr<EndpointCore> ep;
  // The region pairs the operation moves, in order: one for write()/read(), several for
  // writeParts() (every region pair of a rank pair, then one flush and the notification).
  struct Segment {
    uint8_t* local_base = nullptr;
    // The local region's registration, passed with every put/get: UCX then
    // needs no registration cache (kvxfer runs without UCX memory hooks).
    ucp_mem_h local_memh = nullptr;
    uint64_t remote_base = 0;
    ucp_rkey_h rkey = nullptr;
    // One past this segment's last descriptor (index of a triple in `desc`).
    size_t end = 0;
  };
  std::vector<Segment> segs;
  std::vector<uint64_t> desc;
  std::vector<uint8_t> notification;
  bool has_notification = false;
  OpTrace trace;

  // Progress-thread state.
  size_t next = 0;
  size_t seg = 0;
  ucs_status_t status = UCS_OK;
  enum class Phase { kPosting, kFlushing, kNotifying } phase = Phase::kPosting;
};

struct Event {
  // kDropped: a notification refused unread (too large, or not eager); id = its size.
  // kPrepared: a prepared transfer completed; `op` is the transfer, handed back to its owner.
  enum class Kind { kCompletion, kNotification, kEndpointFailed, kDropped, kPrepared } kind;
  uint64_t id = 0;  // transfer id (completion) or endpoint id (failure)
  ucs_status_t status = UCS_OK;
  std::string peer;                // notifications: the sender agent's name
  std::vector<uint8_t> bytes;      // notifications: the payload
  OpTrace trace;                   // completions: the operation's steps
  uint64_t received_us = 0;        // notifications: when the progress thread received it
  std::unique_ptr<TransferOp> op;  // kPrepared: the transfer back (null: lost, UCX still holds it)
  void* owner = nullptr;           // kPrepared: TransferOp::owner
};

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
  size_t max_notification_bytes = 4 << 20;
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
  // Caller-progress mode: posts what is queued and progresses the worker until it is idle
  // (bounded), on the calling thread. Returns whether anything happened.
  bool Progress();
  void TakeEvents(std::vector<Event>* out);

  // Creates an endpoint (progress thread) from a raw UCX worker address.
  [[nodiscard]] ucs_status_t CreateEndpoint(const std::vector<uint8_t>& address, bool peer_mode,
                                            std::shared_ptr<EndpointCore>* out);
  // Closes an endpoint in the background; FORCE in peer mode, flush otherwise.
  void CloseEndpoint(std::shared_ptr<EndpointCore> ep);
  // Fails every operation on `ep` now with `status` (settled for JavaScript) and marks the
  // endpoint failed: for a peer known dead whose operations UCX never completes.
  void AbandonEndpoint(std::shared_ptr<EndpointCore> ep, ucs_status_t status);
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
  void Loop();
  // One turn of the loop: commands, posting, worker progress. Returns whether anything happened.
  bool Turn();
  // Takes an operation over on the progress thread (or the caller's, in caller-progress mode).
  void Accept(std::unique_ptr<TransferOp> owned);
  void Wake();
  bool DrainCommands();           // true when there were any
  bool PostSome(TransferOp* op);  // returns true while descriptors remain
  void StartFlush(TransferOp* op);
  void AfterFlush(TransferOp* op, ucs_status_t status);
  void StartNotify(TransferOp* op);
  void Complete(TransferOp* op, ucs_status_t status);
  void PushEvent(Event ev);
  void CloseEndpointNow(const std::shared_ptr<EndpointCore>& ep);
  bool ShutdownDone();
  void DrainWorker();

  static void OnFlush(void* request, ucs_status_t status, void* user_data);
  static void OnNotifySent(void* request, ucs_status_t status, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnEpClosed(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);

  EngineOptions opts_;
  ucp_context_h context_ = nullptr;
  ContextInfo context_info_;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::vector<uint8_t> worker_address_;

  std::thread thread_;
  bool started_ = false;
  bool shut_down_ = false;            // JS thread
  bool shutdown_requested_ = false;   // JS thread
  std::atomic<bool> stopped_{false};  // set once the thread has been joined

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

  // Progress-thread only.
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
