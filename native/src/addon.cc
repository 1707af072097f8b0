// N-API face of the progress engine: Agent, Region, Endpoint and RemoteRegion
// handles. Every JavaScript input is validated and copied here, on the JS
// thread, before anything is handed to the progress thread ("baton" style);
// results come back as Events and are turned into JavaScript values here.
//
// One file per class (agent.cc, region.cc, endpoint.cc, remote_region.cc),
// their shared helpers in wire.cc and handle.h; this file registers them.
#include <napi.h>
#include <ucp/api/ucp.h>

#include <vector>

#include "agent.h"
#include "endpoint.h"
#include "handle.h"
#include "region.h"
#include "remote_region.h"

namespace kvxfer {

namespace {

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  auto* data = new AddonData();
  data->agent_ctor = Napi::Persistent(AgentWrap::Define(env));
  data->region_ctor = Napi::Persistent(RegionWrap::Define(env));
  data->endpoint_ctor = Napi::Persistent(EndpointWrap::Define(env));
  data->remote_ctor = Napi::Persistent(RemoteWrap::Define(env));
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
  exports.Set("ucxVersion", Napi::String::New(env, ucp_get_version_string()));
  return exports;
}

}  // namespace

}  // namespace kvxfer

static Napi::Object InitKvxfer(Napi::Env env, Napi::Object exports) {
  return kvxfer::Init(env, exports);
}

NODE_API_MODULE(kvxfer, InitKvxfer)
