// What passes between the JavaScript thread and the progress thread: an operation (TransferOp),
// copied out of JavaScript and checked before the hand-off, the endpoint it runs on, when it
// passed each step, and the Events that come back. Plain structs: nothing here touches N-API.
#pragma once

#include <time.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvxfer {

class ProgressEngine;

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
  ProgressEngine* engine = nullptr;
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

// A step's time for `op`'s trace: 0 for a prepared transfer, whose trace nobody reads (six clock
// reads were 5% of a prepared 4 KiB write's CPU, measured with perf).
inline uint64_t Stamp(const TransferOp& op) { return op.prepared ? 0 : MonoUs(); }

struct Event {
  // kDropped: a notification refused unread (too large, or not eager); id = its size.
  // kPrepared: a prepared transfer completed; `op` is the transfer, handed back to its owner.
  // kEndpointSettled: a flush of an endpoint (SettleEndpoint, or AbandonEndpoint's) is over: UCX
  // holds no operation posted on it before the flush; `seq` is the caller's, `status` the flush's.
  enum class Kind {
    kCompletion,
    kNotification,
    kEndpointFailed,
    kDropped,
    kPrepared,
    kEndpointSettled
  } kind;
  uint64_t id = 0;   // transfer id (completion) or endpoint id (failure, settled)
  uint64_t seq = 0;  // kEndpointSettled: the number the caller gave
  ucs_status_t status = UCS_OK;
  std::string peer;                // notifications: the sender agent's name
  std::vector<uint8_t> bytes;      // notifications: the payload
  OpTrace trace;                   // completions: the operation's steps
  uint64_t received_us = 0;        // notifications: when the progress thread received it
  std::unique_ptr<TransferOp> op;  // kPrepared: the transfer back (null: lost, UCX still holds it)
  void* owner = nullptr;           // kPrepared: TransferOp::owner
};

}  // namespace kvxfer
