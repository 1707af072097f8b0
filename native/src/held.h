// The handles an operation uses (its endpoint, local and remote regions), held while it may run:
// their JavaScript objects referenced so that they are not collected, and each counted in flight
// so that a close() waits for it. A promise-based operation holds them until it settles; a
// prepared transfer for as long as it exists.
#pragma once

#include <napi.h>

#include <utility>
#include <vector>

#include "endpoint.h"
#include "region.h"
#include "remote_region.h"

namespace kvxfer {

struct HeldHandles {
  EndpointWrap* ep = nullptr;
  std::vector<RegionWrap*> locals;
  std::vector<RemoteWrap*> remotes;
  std::vector<Napi::ObjectReference> refs;

  void Hold(EndpointWrap* e, std::vector<RegionWrap*> l, std::vector<RemoteWrap*> r) {
    ep = e;
    locals = std::move(l);
    remotes = std::move(r);
    refs.reserve(1 + locals.size() + remotes.size());
    if (ep != nullptr) {
      refs.push_back(Napi::Persistent(ep->Value()));
      ep->inflight_++;
    }
    for (RegionWrap* x : locals) {
      refs.push_back(Napi::Persistent(x->Value()));
      x->inflight_++;
    }
    for (RemoteWrap* x : remotes) {
      refs.push_back(Napi::Persistent(x->Value()));
      x->inflight_++;
    }
  }

  // Counts each handle out (a close that waited for it goes on) and drops the references.
  void Release() {
    if (ep != nullptr) ep->OpDone();
    for (RegionWrap* x : locals) x->OpDone();
    for (RemoteWrap* x : remotes) x->OpDone();
    ep = nullptr;
    locals.clear();
    remotes.clear();
    refs.clear();
  }
};

}  // namespace kvxfer
