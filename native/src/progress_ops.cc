// The life of one operation on the progress thread (or the caller's, in caller-progress mode):
// taken over, its puts or gets posted in chunks, one flush, then its notification if it carries
// one, and its completion queued for JavaScript; and the notifications that arrive from peers.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "progress.h"

namespace kvxfer {

namespace {

// Descriptors posted per transfer per loop turn: large enough to keep the
// transport busy, small enough that commands and other transfers interleave.
constexpr size_t kPostChunk = 512;
// ...and at most this many bytes: on shared memory a put copies synchronously,
// so one turn over large descriptors would otherwise hold notifications
// (heartbeats included) back for as long as the whole transfer takes.
constexpr uint64_t kPostChunkBytes = 8ull << 20;

}  // namespace

void ProgressEngine::Accept(std::unique_ptr<TransferOp> owned, bool post_here) {
  owned->trace.started = Stamp(*owned);
  uint64_t id = owned->id;
  TransferOp* p = owned.get();
  ops_[id] = std::move(owned);
  if (stopping_) {
    Complete(p, UCS_ERR_CANCELED);
  } else if (p->ep->failed.load()) {
    Complete(p, p->ep->fail_status);
  } else if (p->kind == OpKind::kNotify) {
    StartNotify(p);
  } else if ((opts_.caller_progress || post_here) && posting_.empty()) {
    // Posted inside the caller's own call: no queue, no hand-off.
    if (PostSome(p)) posting_.push_back(p);
  } else {
    posting_.push_back(p);
  }
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
  if (op->next == 0) op->trace.first_post = Stamp(*op);
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
    op->trace.posted = Stamp(*op);
    StartFlush(op);
    return false;
  }
  return true;
}

ucs_status_ptr_t ProgressEngine::FlushWith(ucp_ep_h ep, ucp_send_nbx_callback_t cb,
                                           void* user_data) {
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = cb;
  param.user_data = user_data;
  return ucp_ep_flush_nbx(ep, &param);
}

void ProgressEngine::StartFlush(TransferOp* op) {
  op->phase = TransferOp::Phase::kFlushing;
  EndpointCore* ep = op->ep.get();
  if (ep->ep == nullptr) {
    Complete(op, op->status != UCS_OK ? op->status : UCS_ERR_NOT_CONNECTED);
    return;
  }
  ucs_status_ptr_t req = FlushWith(ep->ep, &ProgressEngine::OnFlush, op);
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
  op->trace.flushed = Stamp(*op);
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
    op->trace.notified = Stamp(*op);
    Complete(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    Complete(op, UCS_PTR_STATUS(req));
  }
}

void ProgressEngine::OnNotifySent(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<TransferOp*>(user_data);
  ucp_request_free(request);
  op->trace.notified = Stamp(*op);
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
  ev.trace.completed = Stamp(*op);
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
