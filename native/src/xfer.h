// PreparedTransfer: a write or read checked once (Agent.prepare) and posted again and again with
// post(), its state polled with state(): no promise, no argument checks and no allocation per
// post, as NIXL reposts a prepared transfer handle. The operation travels to the progress thread
// (or is posted in place, with caller progress) and comes back through the event queue.
#pragma once

#include <napi.h>

#include <memory>
#include <vector>

#include "handle.h"
#include "held.h"
#include "progress.h"

namespace kvxfer {

class EndpointWrap;
class RegionWrap;
class RemoteWrap;

class XferWrap : public Napi::ObjectWrap<XferWrap>, public Child {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit XferWrap(const Napi::CallbackInfo& info);
  ~XferWrap() override { Release(false); }
  void CloseFromParent(bool js) override { Release(js); }

  // Set by the agent right after construction: the operation and the handles it uses, which stay
  // referenced (and cannot be released) until this transfer closes.
  void Init(Napi::Env env, std::unique_ptr<TransferOp> op, EndpointWrap* ep,
            std::vector<RegionWrap*> locals, std::vector<RemoteWrap*> remotes);
  // The operation is back from the engine (`op` null: lost, UCX still holds it).
  void Returned(std::unique_ptr<TransferOp> op, ucs_status_t status);
  bool open() const { return state_ == HandleState::kOpen; }

 private:
  Napi::Value Post(const Napi::CallbackInfo& info);
  Napi::Value State(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);
  void Release(bool js);

  HandleState state_ = HandleState::kOpen;
  std::unique_ptr<TransferOp> op_;  // null while posted
  bool posted_ = false;
  bool lost_ = false;
  bool ever_posted_ = false;
  ucs_status_t last_ = UCS_OK;
  HeldHandles held_;            // for as long as it exists
  Napi::ObjectReference self_;  // strong (count 1) while posted: not collected under UCX
};

}  // namespace kvxfer
