// Agent: one UCX context, worker and progress thread (a ProgressEngine), the
// parent of every Region, Endpoint and RemoteRegion made through it.
#pragma once

#include <napi.h>
#include <uv.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cuda.h"
#include "endpoint.h"
#include "handle.h"
#include "held.h"
#include "memory_type.h"
#include "progress.h"

namespace kvxfer {

class RegionWrap;
class RemoteWrap;

// Shared between the agent and queued thread-safe calls, so a call that runs
// after the agent closed finds nothing to do.
struct AgentLink {
  AgentWrap* agent = nullptr;
};

// The event loop's watch on the engine's worker (ProgressEngine::loop_fd): a libuv poll handle,
// freed by its close callback.
struct LoopWatch {
  uv_poll_t handle;
  std::shared_ptr<AgentLink> link;
};

class AgentWrap : public Napi::ObjectWrap<AgentWrap>, public Parent {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit AgentWrap(const Napi::CallbackInfo& info);
  ~AgentWrap() override;

  // Parent: what its child handles ask of it.
  ProgressEngine* engine() override { return engine_.get(); }
  bool open() const override { return state_ == HandleState::kOpen; }
  void Adopt(Child* c) override {
    c->agent_ = this;
    children_.insert(c);
  }
  void Forget(Child* c) override { children_.erase(c); }
  void PostPrepared(Napi::Env env, std::unique_ptr<TransferOp> op) override;
  void Unregister(EndpointWrap* ep) override {
    if (ep->core_) endpoints_.erase(ep->core_->id);
  }
  void Register(EndpointWrap* ep) { endpoints_[ep->core_->id] = ep; }
  // Closes everything; delivers outstanding completions when `env` is usable.
  void CloseAll(Napi::Env env, bool deliver);

 private:
  struct Pending {
    explicit Pending(Napi::Env env) : deferred(Napi::Promise::Deferred::New(env)) {}
    Napi::Promise::Deferred deferred;
    OpKind kind = OpKind::kWrite;
    HeldHandles held;  // until it settles
  };

  // agent.cc: the object itself (its accessors, connect(), progress(), close()) and the
  // operations it tracks until they settle.
  Napi::Value Address(const Napi::CallbackInfo& info);
  Napi::Value Name(const Napi::CallbackInfo& info);
  Napi::Value Inflight(const Napi::CallbackInfo& info);
  Napi::Value InlinePosts(const Napi::CallbackInfo& info);
  Napi::Value LoopTurns(const Napi::CallbackInfo& info);
  Napi::Value Transports(const Napi::CallbackInfo& info);
  Napi::Value MemoryTypes(const Napi::CallbackInfo& info);
  Napi::Value Connect(const Napi::CallbackInfo& info);
  Napi::Value Progress(const Napi::CallbackInfo& info);
  Napi::Value WatchPrepared(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);
  Napi::Value BeginClose(const Napi::CallbackInfo& info);
  void CheckOpen(Napi::Env env, const char* what);
  // Gives `op` its id and a pending promise holding its handles; the caller then submits it.
  Napi::Value Track(Napi::Env env, TransferOp* op, EndpointWrap* ep,
                    std::vector<RegionWrap*> locals, std::vector<RemoteWrap*> remotes);
  // Settles and delivers what the engine has queued; returns the operations settled.
  size_t Deliver(Napi::Env env);
  // Settles one completion's promise; a success resolves with its trace, the next slot of
  // `traces` (*used counts the slots taken).
  void Settle(Napi::Env env, const Event& ev, uint64_t delivered_us, Napi::ArrayBuffer& traces,
              size_t* used);
  void UpdateRef(Napi::Env env);
  // The event loop's watch (EngineOptions::loop_wake): started with the agent, closed with it.
  void StartLoopWatch(Napi::Env env);
  void StopLoopWatch();
  // The watch fired: the engine's LoopTurn, then what it produced delivered at once.
  void OnWorkerReadable();

  // agent_memory.cc: host memory registered as regions.
  Napi::Value RegisterMemory(const Napi::CallbackInfo& info);
  Napi::Value RegisterAddress(const Napi::CallbackInfo& info);
  Napi::Value MapFile(const Napi::CallbackInfo& info);
  Napi::Value Allocate(const Napi::CallbackInfo& info);
  Napi::Value AttachSegment(const Napi::CallbackInfo& info);
  ucs_status_t RegisterRange(void* addr, size_t length, ucp_mem_h* memh, MemKind kind);
  // A new Region handle, adopted by this agent (its memory set by the caller's Init*).
  RegionWrap* NewRegion(Napi::Env env, Napi::Object* obj);

  // agent_cuda.cc: CUDA device memory opened from an IPC handle or allocated here.
  Napi::Value OpenCudaIpc(const Napi::CallbackInfo& info);
  Napi::Value AllocateCuda(const Napi::CallbackInfo& info);
  Napi::Object CudaRegion(Napi::Env env, const char* what, std::shared_ptr<cuda::DeviceMemory> mem,
                          uint64_t offset, uint64_t length);

  // agent_transfer.cc: transfers checked and handed to the engine.
  struct Built {
    std::unique_ptr<TransferOp> op;
    EndpointWrap* ep = nullptr;
    std::vector<RegionWrap*> locals;
    std::vector<RemoteWrap*> remotes;
  };
  Built BuildTransfer(Napi::Env env, const std::string& what, const Napi::Value* args, size_t n);
  // The same from a call's own arguments (transfer(), prepare()).
  Built BuildTransfer(const Napi::CallbackInfo& info, const std::string& what);
  Napi::Value Transfer(const Napi::CallbackInfo& info);
  Napi::Value TransferMany(const Napi::CallbackInfo& info);
  Napi::Value Prepare(const Napi::CallbackInfo& info);
  Napi::Value WriteParts(const Napi::CallbackInfo& info);
  Napi::Value Notify(const Napi::CallbackInfo& info);
  // One region pair of a transfer: checks its handles and descriptors, appends them to `op`.
  // `where` leads descriptor errors ("writeParts part 2: "; empty for transfer()).
  void AddSegment(Napi::Env env, const char* what, const std::string& where, EndpointWrap* ep,
                  const Napi::Value& local_v, const Napi::Value& remote_v, const Napi::Value& descs,
                  TransferOp* op, std::vector<RegionWrap*>* locals,
                  std::vector<RemoteWrap*>* remotes);
  void SetNotification(Napi::Env env, const char* what, const Napi::Value& v, TransferOp* op);
  // An endpoint of this agent, open; otherwise ERR_CLOSED / ERR_WRONG_AGENT naming `what`.
  EndpointWrap* OpenEndpoint(Napi::Env env, const Napi::Value& v, const char* what);

  std::unique_ptr<ProgressEngine> engine_;
  HandleState state_ = HandleState::kOpen;
  Napi::ThreadSafeFunction tsfn_;
  bool tsfn_ref_ = false;
  std::shared_ptr<AgentLink> link_;
  LoopWatch* loop_watch_ = nullptr;
  napi_env loop_env_ = nullptr;
  std::unique_ptr<Napi::AsyncContext> loop_context_;
  Napi::FunctionReference on_event_;
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending_;
  std::vector<Event> delivering_;  // Deliver()'s batch, kept to reuse its storage
  std::unordered_set<Child*> children_;
  std::unordered_map<uint64_t, EndpointWrap*> endpoints_;
  uint64_t next_op_id_ = 1;
  uint64_t prepared_posted_ = 0;  // prepared transfers in flight
  bool watch_prepared_ = false;   // report returned prepared transfers (`prepared` events)
  AddonData* data_ = nullptr;
};

}  // namespace kvxfer
