// What the handle classes share: their open/closing/closed state, a child
// handle's link to its agent (Parent: what a child may ask of it), the addon's
// per-environment data, and the token that keeps JavaScript from constructing
// child handles itself.
#pragma once

#include <napi.h>

#include <cstdint>
#include <memory>
#include <unordered_set>
#include <vector>

namespace kvxfer {

enum class HandleState { kOpen, kClosing, kClosed };

class AgentWrap;
class Child;
class EndpointWrap;
class ProgressEngine;
struct TransferOp;

// What a child handle asks of the agent that owns it. AgentWrap (agent.h) is the one Parent; the
// handle classes reach it through this, so that none of them depends on the agent's own header.
class Parent {
 public:
  // Null once the agent has shut its engine down.
  virtual ProgressEngine* engine() = 0;
  virtual bool open() const = 0;
  virtual void Adopt(Child* c) = 0;
  virtual void Forget(Child* c) = 0;
  virtual void Unregister(EndpointWrap* ep) = 0;
  // A prepared transfer posted (xfer.cc): handed to the engine, counted until it comes back.
  virtual void PostPrepared(Napi::Env env, std::unique_ptr<TransferOp> op) = 0;

 protected:
  ~Parent() = default;
};

// A handle owned by an agent: closed by its parent when the agent closes.
class Child {
 public:
  virtual ~Child() = default;
  // `js`: called where JavaScript handles may be made (not from a finalizer or
  // the environment's cleanup hook).
  virtual void CloseFromParent(bool js) = 0;
  Parent* agent_ = nullptr;
};

struct AddonData {
  Napi::FunctionReference agent_ctor;
  Napi::FunctionReference region_ctor;
  Napi::FunctionReference endpoint_ctor;
  Napi::FunctionReference remote_ctor;
  Napi::FunctionReference xfer_ctor;
  std::unordered_set<AgentWrap*> agents;
};

// Each handle class tags its objects (napi_type_tag_object) so that an argument is recognised by
// its tag: one lookup, where instanceof walked the prototype chain (a tenth of a polling agent's
// CPU per small request).
inline constexpr napi_type_tag kRegionTag = {0x6b7678665265676eULL, 0x696f6e0000000001ULL};
inline constexpr napi_type_tag kEndpointTag = {0x6b76786645706f69ULL, 0x6e74000000000002ULL};
inline constexpr napi_type_tag kRemoteTag = {0x6b767866526d7452ULL, 0x67000000000003ULL};

inline void TagObject(Napi::Env env, Napi::Object o, const napi_type_tag& tag) {
  napi_type_tag_object(env, o, &tag);
}

inline bool HasTag(Napi::Env env, const Napi::Value& v, const napi_type_tag& tag) {
  if (!v.IsObject()) return false;
  bool ok = false;
  return napi_check_object_type_tag(env, v, &tag, &ok) == napi_ok && ok;
}

// Constructors of child handles take this token so JavaScript cannot call them.
constexpr uint32_t kCtorToken = 0x6b767866;

inline bool IsInternalCall(const Napi::CallbackInfo& info) {
  return info.Length() >= 1 && info[0].IsNumber() &&
         info[0].As<Napi::Number>().Uint32Value() == kCtorToken;
}

}  // namespace kvxfer
