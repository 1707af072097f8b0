// N-API face of the progress engine: Agent, Region, Endpoint and RemoteRegion
// handles. Every JavaScript input is validated and copied here, on the JS
// thread, before anything is handed to the progress thread ("baton" style);
// results come back as Events and are turned into JavaScript values here.
//
// One file per class (agent.cc, region.cc, endpoint.cc, remote_region.cc, xfer.cc; the
// agent's memory and transfer methods in agent_memory.cc and agent_transfer.cc), their shared
// helpers in wire.cc and handle.h; this file registers them.
#include <napi.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <string>
#include <vector>

#include "agent.h"
#include "endpoint.h"
#include "handle.h"
#include "mac.h"
#include "memory_type.h"
#include "region.h"
#include "remote_region.h"
#include "ucx_fix.h"
#include "ucx_status.h"
#include "wire.h"
#include "xfer.h"

namespace kvxfer {

namespace {

// ucxInfo(transports?): the UCX this process runs on, as a context opened now sees it (the
// UCX_* variables of the environment apply; `transports`, as UCX_TLS, overrides theirs):
// { version, transports: ["tl/dev", ...], memoryTypes: ["host", ...] }.
Napi::Value UcxInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) throw UcsError(env, "ucxInfo: ucp_config_read failed", status);
  if (info.Length() >= 1 && info[0].IsString() && !info[0].As<Napi::String>().Utf8Value().empty()) {
    const std::string tls = info[0].As<Napi::String>().Utf8Value();
    status = ucp_config_modify(config, "TLS", tls.c_str());
    if (status != UCS_OK) {
      ucp_config_release(config);
      throw UcsError(env, "ucxInfo: invalid transport list '" + tls + "'", status);
    }
  }
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) throw UcsError(env, "ucxInfo: ucp_init failed", status);
  ContextInfo ci = QueryContext(context);
  ucp_cleanup(context);
  Napi::Object o = Napi::Object::New(env);
  o.Set("version", Napi::String::New(env, ucp_get_version_string()));
  o.Set("transports", StringArray(env, ci.resources));
  o.Set("memoryTypes", StringArray(env, MemoryTypeNames(ci.memory_types)));
  return o;
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  auto* data = new AddonData();
  data->agent_ctor = Napi::Persistent(AgentWrap::Define(env));
  data->region_ctor = Napi::Persistent(RegionWrap::Define(env));
  data->endpoint_ctor = Napi::Persistent(EndpointWrap::Define(env));
  data->remote_ctor = Napi::Persistent(RemoteWrap::Define(env));
  data->xfer_ctor = Napi::Persistent(XferWrap::Define(env));
  env.SetInstanceData<AddonData>(data);
  // Handles left open at exit: close every agent (and so its children)
  // before the environment goes away. No JavaScript runs from here.
  env.AddCleanupHook([data, env]() {
    std::vector<AgentWrap*> agents(data->agents.begin(), data->agents.end());
    for (AgentWrap* a : agents) a->CloseAll(env, false);
  });
  exports.Set("Agent", data->agent_ctor.Value());
  exports.Set("Region", data->region_ctor.Value());
  exports.Set("Endpoint", data->endpoint_ctor.Value());
  exports.Set("RemoteRegion", data->remote_ctor.Value());
  exports.Set("PreparedTransfer", data->xfer_ctor.Value());
  exports.Set("MacKey", MacKey::Define(env));
  exports.Set("ucxVersion", Napi::String::New(env, ucp_get_version_string()));
  exports.Set("ucxInfo", Napi::Function::New(env, UcxInfo, "ucxInfo"));
  // Before any worker exists: the handler it replaces is read when a worker's interfaces start.
  InstallUcxGetReplyFix();
  exports.Set("ucxGetReplyFix", Napi::Function::New(
                                    env,
                                    [](const Napi::CallbackInfo& info) -> Napi::Value {
                                      return Napi::String::New(info.Env(), UcxGetReplyFixState());
                                    },
                                    "ucxGetReplyFix"));
  exports.Set("ucsStatusName", Napi::Function::New(
                                   env,
                                   [](const Napi::CallbackInfo& info) -> Napi::Value {
                                     int s = info.Length() > 0 && info[0].IsNumber()
                                                 ? info[0].As<Napi::Number>().Int32Value()
                                                 : 0;
                                     return Napi::String::New(
                                         info.Env(), UcsStatusName(static_cast<ucs_status_t>(s)));
                                   },
                                   "ucsStatusName"));
  return exports;
}

}  // namespace

}  // namespace kvxfer

static Napi::Object InitKvxfer(Napi::Env env, Napi::Object exports) {
  return kvxfer::Init(env, exports);
}

NODE_API_MODULE(kvxfer, InitKvxfer)
