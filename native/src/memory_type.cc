#include "memory_type.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace kvxfer {

bool ParseMemKind(const std::string& name, MemKind* out) {
  if (name == "host") {
    *out = MemKind::kHost;
  } else if (name == "cuda") {
    *out = MemKind::kCuda;
  } else if (name == "cuda-host") {
    *out = MemKind::kCudaHost;
  } else {
    return false;
  }
  return true;
}

const char* MemKindName(MemKind kind) {
  switch (kind) {
    case MemKind::kHost:
      return "host";
    case MemKind::kCuda:
      return "cuda";
    case MemKind::kCudaHost:
      return "cuda-host";
  }
  return "host";
}

ucs_memory_type_t UcsMemoryType(MemKind kind) {
  return kind == MemKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

ContextInfo QueryContext(ucp_context_h context) {
  ContextInfo info;
  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context, &attr) == UCS_OK) info.memory_types = attr.memory_types;

  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return info;
  ucp_context_print_info(context, f);
  std::fclose(f);
  // "#      resource 3  :  md 2  dev 0  flags -- sysv/memory"
  std::istringstream lines(std::string(text, size));
  std::free(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find("resource") == std::string::npos) continue;
    size_t dash = line.find("-- ");
    if (dash == std::string::npos) continue;
    std::string res = line.substr(dash + 3);
    while (!res.empty() && (res.back() == ' ' || res.back() == '\r')) res.pop_back();
    if (res.empty()) continue;
    info.resources.push_back(res);
    std::string tl = res.substr(0, res.find('/'));
    bool seen = false;
    for (const std::string& t : info.transports) seen = seen || t == tl;
    if (!seen) info.transports.push_back(tl);
  }
  return info;
}

std::vector<std::string> MemoryTypeNames(uint64_t mask) {
  static const struct {
    ucs_memory_type_t type;
    const char* name;
  } kNames[] = {
      {UCS_MEMORY_TYPE_HOST, "host"},
      {UCS_MEMORY_TYPE_CUDA, "cuda"},
      {UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"},
      {UCS_MEMORY_TYPE_ROCM, "rocm"},
      {UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"},
      {UCS_MEMORY_TYPE_RDMA, "rdma"},
      {UCS_MEMORY_TYPE_ZE_HOST, "ze-host"},
      {UCS_MEMORY_TYPE_ZE_DEVICE, "ze-device"},
      {UCS_MEMORY_TYPE_ZE_MANAGED, "ze-managed"},
  };
  std::vector<std::string> out;
  for (const auto& n : kNames) {
    if ((mask >> static_cast<unsigned>(n.type)) & 1u) out.push_back(n.name);
  }
  return out;
}

std::string RefusalFor(MemKind kind, const ContextInfo& info) {
  const ucs_memory_type_t type = UcsMemoryType(kind);
  if ((info.memory_types >> static_cast<unsigned>(type)) & 1u) return "";
  std::string served;
  for (const std::string& n : MemoryTypeNames(info.memory_types)) {
    served += (served.empty() ? "" : ", ") + n;
  }
  std::string tls;
  for (const std::string& t : info.transports) tls += (tls.empty() ? "" : ", ") + t;
  std::string why = std::string(MemKindName(kind)) + " memory: this UCX (" +
                    ucp_get_version_string() + ") serves " +
                    (served.empty() ? std::string("no memory type") : served) +
                    " memory only, with transports " + (tls.empty() ? "(none)" : tls);
  if (kind == MemKind::kCuda) {
    why +=
        "; CUDA device memory needs UCX's cuda transports (cuda_copy, cuda_ipc), which load only "
        "where a CUDA driver (libcuda.so.1) and a GPU are present";
  }
  return why;
}

}  // namespace kvxfer
