// The engine's shutdown: queued transfers cancelled, endpoints closed within a deadline, the
// thread stopped, the worker drained and destroyed.
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "progress.h"

namespace kvxfer {

namespace {

// How long Shutdown() waits for in-flight operations and endpoint closes. Measured here: 20
// writes of 20 000 descriptors cancelled by a close took over 2 s to flush on a loaded 2-core VM.
constexpr auto kShutdownDeadline = std::chrono::seconds(10);
// After the last endpoint closed: how long, and for how many idle progress calls, the worker is
// still progressed before it is destroyed (DrainWorker).
constexpr auto kDrainBound = std::chrono::milliseconds(200);
constexpr int kDrainIdleCalls = 20;

}  // namespace

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

}  // namespace kvxfer
