// The engine's endpoints and remote keys, all touched on the progress thread: created, closed
// (flushed, or forced in peer error mode), abandoned with their operations when a peer is known
// dead, and failed by UCX's error callback.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "progress.h"

namespace kvxfer {

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

void ProgressEngine::AbandonEndpoint(std::shared_ptr<EndpointCore> ep, ucs_status_t status,
                                     uint64_t settle_seq) {
  RunAsync([this, ep, status, settle_seq] {
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
    if (settle_seq != 0) FlushToSettle(ep, settle_seq);
  });
}

void ProgressEngine::SettleEndpoint(std::shared_ptr<EndpointCore> ep, uint64_t seq) {
  RunAsync([this, ep, seq] { FlushToSettle(ep, seq); });
}

namespace {
struct SettleFlush {
  ProgressEngine* engine;
  uint64_t ep_id;
  uint64_t seq;
};
}  // namespace

// A flush of the endpoint completes once UCX has finished every operation posted on it before,
// abandoned ones included (over TCP: a put once the peer acknowledged it, a get once its reply
// landed), or fails with the endpoint. In error mode none on a link that never comes back it
// never completes: the caller bounds its wait.
void ProgressEngine::FlushToSettle(const std::shared_ptr<EndpointCore>& ep, uint64_t seq) {
  if (!ep->ep || stopping_) {
    PushSettled(ep->id, seq, ep->ep ? UCS_ERR_CANCELED : UCS_OK);
    return;
  }
  auto* ctx = new SettleFlush{this, ep->id, seq};
  ucs_status_ptr_t req = FlushWith(ep->ep, &ProgressEngine::OnSettleFlushed, ctx);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    delete ctx;
    PushSettled(ep->id, seq, UCS_PTR_STATUS(req));
  }
}

void ProgressEngine::OnSettleFlushed(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<SettleFlush*>(user_data);
  ucp_request_free(request);
  ctx->engine->PushSettled(ctx->ep_id, ctx->seq, status);
  delete ctx;
}

void ProgressEngine::PushSettled(uint64_t ep_id, uint64_t seq, ucs_status_t status) {
  Event ev;
  ev.kind = Event::Kind::kEndpointSettled;
  ev.id = ep_id;
  ev.seq = seq;
  ev.status = status;
  PushEvent(std::move(ev));
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

}  // namespace kvxfer
