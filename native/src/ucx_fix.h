#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace kvxfer {

// Works around UCX 1.22's uninitialised datatype in software GET replies, which crashes the
// memory's owner when its endpoint fails with a reply queued (ucx_fix.cc). Install before the
// first worker is created (idempotent); check each worker once it exists.
void InstallUcxGetReplyFix();
void CheckUcxGetReplyFix(ucp_worker_h worker);
// "installed (N GET replies primed)", or why not.
std::string UcxGetReplyFixState();

}  // namespace kvxfer
