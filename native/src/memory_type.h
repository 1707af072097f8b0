// Memory types: what a region's memory is (host, CUDA device, CUDA host-pinned), the UCX memory
// type each registers as, and what the running UCX context can serve (its transports and memory
// types, read back from UCX itself).
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer {

enum class MemKind { kHost, kCuda, kCudaHost };

// "host" | "cuda" | "cuda-host"; false for anything else.
bool ParseMemKind(const std::string& name, MemKind* out);
const char* MemKindName(MemKind kind);
// The UCX memory type a region of `kind` is registered as. CUDA host-pinned memory is host memory
// to UCX (every host transport reaches it; cuda_copy uses it for staging).
ucs_memory_type_t UcsMemoryType(MemKind kind);

struct ContextInfo {
  // "transport/device" for every resource the context opened, e.g. "cma/memory", "tcp/eth0".
  std::vector<std::string> resources;
  // Transport names only, deduplicated, in the order UCX lists them.
  std::vector<std::string> transports;
  // Bit i set: UCX serves ucs_memory_type_t i (UCP_ATTR_FIELD_MEMORY_TYPES).
  uint64_t memory_types = 0;
};

// What `context` opened and serves. Reads ucp_context_print_info's resource lines.
ContextInfo QueryContext(ucp_context_h context);

// Names of the memory types in `mask` that kvxfer knows ("host", "cuda", ...).
std::vector<std::string> MemoryTypeNames(uint64_t mask);

// Why a region of `kind` cannot be registered on a context with `info`, or "" when it can.
std::string RefusalFor(MemKind kind, const ContextInfo& info);

}  // namespace kvxfer
