// What the handle classes share: their open/closing/closed state, a child
// handle's link to its agent, the addon's per-environment data, and the token
// that keeps JavaScript from constructing child handles itself.
#pragma once

#include <napi.h>

#include <cstdint>
#include <unordered_set>

namespace kvxfer {

enum class HandleState { kOpen, kClosing, kClosed };

class AgentWrap;

// A handle owned by an agent: closed by its parent when the agent closes.
class Child {
 public:
  virtual ~Child() = default;
  // `js`: called where JavaScript handles may be made (not from a finalizer or
  // the environment's cleanup hook).
  virtual void CloseFromParent(bool js) = 0;
  AgentWrap* agent_ = nullptr;
};

struct AddonData {
  Napi::FunctionReference agent_ctor;
  Napi::FunctionReference region_ctor;
  Napi::FunctionReference endpoint_ctor;
  Napi::FunctionReference remote_ctor;
  std::unordered_set<AgentWrap*> agents;
};

// Constructors of child handles take this token so JavaScript cannot call them.
constexpr uint32_t kCtorToken = 0x6b767866;

inline bool IsInternalCall(const Napi::CallbackInfo& info) {
  return info.Length() >= 1 && info[0].IsNumber() &&
         info[0].As<Napi::Number>().Uint32Value() == kCtorToken;
}

}  // namespace kvxfer
