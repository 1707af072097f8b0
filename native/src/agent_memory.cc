// The agent's host-memory methods: memory registered with UCX from a JavaScript buffer, an
// address, a mapped file (confined as confine.h says), memory UCX allocates, or a SysV segment
// (segment.h). Each becomes a Region adopted by this agent.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>

#include "agent.h"
#include "confine.h"
#include "region.h"
#include "segment.h"
#include "wire.h"

namespace kvxfer {

RegionWrap* AgentWrap::NewRegion(Napi::Env env, Napi::Object* obj) {
  *obj = data_->region_ctor.New({Napi::Number::New(env, kCtorToken)});
  RegionWrap* region = RegionWrap::Unwrap(*obj);
  Adopt(region);
  return region;
}

// Registers memory the caller mapped, [addr, addr + length), with this agent's UCX context, as
// memory of `kind` (given, so UCX does not have to detect it).
ucs_status_t AgentWrap::RegisterRange(void* addr, size_t length, ucp_mem_h* memh, MemKind kind) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = addr;
  params.length = length;
  params.memory_type = UcsMemoryType(kind);
  return ucp_mem_map(engine_->context(), &params, memh);
}

// registerAddress(address: bigint, length, memoryType: "host" | "cuda" | "cuda-host", device):
// memory this process reaches at `address` that JavaScript does not own: CUDA device memory (a
// tensor's pointer, or one opened from a CUDA IPC handle), CUDA host-pinned memory. A type the
// running UCX cannot serve is refused by name, with the transports it found.
Napi::Value AgentWrap::RegisterAddress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "registerAddress");
  if (info.Length() < 3 || !info[0].IsBigInt() || !info[1].IsNumber() || !info[2].IsString()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "registerAddress(address: bigint, length: number, memoryType: string, "
                    "device?: number)");
  }
  bool lossless = false;
  uint64_t address = info[0].As<Napi::BigInt>().Uint64Value(&lossless);
  if (!lossless || address == 0) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "registerAddress: address must be a non-zero 64-bit unsigned integer");
  }
  double len_d = info[1].As<Napi::Number>().DoubleValue();
  if (!(len_d > 0) || std::floor(len_d) != len_d || len_d > 9007199254740992.0 ||
      address + static_cast<uint64_t>(len_d) < address) {
    throw MakeError(env, "ERR_INVALID_LENGTH",
                    "registerAddress: length must be a positive integer that does not wrap the "
                    "address space",
                    UCS_OK, true);
  }
  const std::string type_name = info[2].As<Napi::String>().Utf8Value();
  MemKind kind;
  if (!ParseMemKind(type_name, &kind)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "registerAddress: memoryType must be 'host', 'cuda' or 'cuda-host', got '" +
                        type_name + "'");
  }
  int device = -1;
  if (info.Length() >= 4 && info[3].IsNumber()) device = info[3].As<Napi::Number>().Int32Value();
  if (kind != MemKind::kHost && device < 0) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    std::string("registerAddress: a ") + MemKindName(kind) +
                        " region needs its CUDA device index (device >= 0)");
  }
  const std::string refusal = RefusalFor(kind, engine_->context_info());
  if (!refusal.empty()) {
    throw MakeError(env, "ERR_MEMORY_TYPE_UNSUPPORTED",
                    "registerAddress: cannot register " + refusal);
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t status = RegisterRange(reinterpret_cast<void*>(static_cast<uintptr_t>(address)),
                                      static_cast<size_t>(len_d), &memh, kind);
  if (status != UCS_OK) {
    throw UcsError(
        env,
        std::string("registerAddress: ucp_mem_map failed for ") + MemKindName(kind) + " memory",
        status);
  }
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  region->InitAddress(reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(address)),
                      static_cast<size_t>(len_d), memh, kind, device);
  return obj;
}

// registerMemory(bufferOrView)
Napi::Value AgentWrap::RegisterMemory(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "registerMemory");
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (info.Length() < 1 || !BytesOf(info[0], &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "registerMemory expects a Buffer, TypedArray or ArrayBuffer");
  }
  if (size == 0)
    throw MakeError(env, "ERR_INVALID_LENGTH", "registerMemory: the memory is empty", UCS_OK, true);
  ucp_mem_h memh = nullptr;
  ucs_status_t status = RegisterRange(const_cast<uint8_t*>(data), size, &memh, MemKind::kHost);
  if (status != UCS_OK) throw UcsError(env, "ucp_mem_map failed", status);
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  region->InitBuffer(env, info[0], const_cast<uint8_t*>(data), size, memh);
  return obj;
}

// mapFile(path, offset, length, options?): maps a shared-memory file and registers it.
// options.confineDir (string, non-empty): open the file as OpenConfined does.
// options.populate (boolean): pre-fault the whole mapping (MAP_POPULATE).
Napi::Value AgentWrap::MapFile(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "mapFile");
  if (info.Length() < 3 || !info[0].IsString() || !info[1].IsNumber() || !info[2].IsNumber() ||
      (info.Length() >= 4 && !info[3].IsUndefined() && !info[3].IsObject())) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "mapFile(path, offset, length, options?) expects a string, two numbers and "
                    "an optional object");
  }
  std::string path = info[0].As<Napi::String>().Utf8Value();
  double off_d = info[1].As<Napi::Number>().DoubleValue();
  double len_d = info[2].As<Napi::Number>().DoubleValue();
  std::string confine_dir;
  bool populate = false;
  if (info.Length() >= 4 && info[3].IsObject()) {
    Napi::Object o = info[3].As<Napi::Object>();
    Napi::Value dir = o.Get("confineDir");
    if (!dir.IsUndefined()) {
      if (!dir.IsString()) {
        throw MakeError(env, "ERR_INVALID_ARGUMENT", "mapFile: confineDir must be a string");
      }
      confine_dir = dir.As<Napi::String>().Utf8Value();
      if (confine_dir.empty() || confine_dir[0] != '/') {
        throw MakeError(env, "ERR_INVALID_ARGUMENT",
                        "mapFile: confineDir must be an absolute path");
      }
    }
    Napi::Value pop = o.Get("populate");
    if (!pop.IsUndefined()) {
      if (!pop.IsBoolean()) {
        throw MakeError(env, "ERR_INVALID_ARGUMENT", "mapFile: populate must be a boolean");
      }
      populate = pop.As<Napi::Boolean>().Value();
    }
  }
  if (!(off_d >= 0) || std::floor(off_d) != off_d || off_d > 9007199254740992.0) {
    throw MakeError(env, "ERR_INVALID_OFFSET", "mapFile: offset must be a non-negative integer",
                    UCS_OK, true);
  }
  if (!(len_d > 0) || std::floor(len_d) != len_d || len_d > 9007199254740992.0) {
    throw MakeError(env, "ERR_INVALID_LENGTH", "mapFile: length must be a positive integer", UCS_OK,
                    true);
  }
  uint64_t offset = static_cast<uint64_t>(off_d), length = static_cast<uint64_t>(len_d);
  int fd;
  if (!confine_dir.empty()) {
    fd = OpenConfined(env, path, confine_dir);
  } else {
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      int e = errno;
      throw MakeError(env, e == ENOENT ? "ERR_NO_SUCH_FILE" : "ERR_FILE",
                      "mapFile: cannot open '" + path + "': " + std::strerror(e));
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    throw MakeError(env, "ERR_FILE", "mapFile: cannot stat '" + path + "': " + std::strerror(e));
  }
  if (offset + length > static_cast<uint64_t>(st.st_size) || offset + length < offset) {
    close(fd);
    throw MakeError(env, "ERR_OUT_OF_BOUNDS",
                    "mapFile: offset " + std::to_string(offset) + " + length " +
                        std::to_string(length) + " exceeds the size of '" + path + "' (" +
                        std::to_string(st.st_size) + " bytes)",
                    UCS_OK, true);
  }
  // mmap needs a page-aligned offset; map from the page boundary below it.
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t map_off = offset - offset % page;
  size_t map_len = static_cast<size_t>(length + (offset - map_off));
  // Populated at once only when asked: it spares the first WRITE or READ into each page of
  // this mapping a page fault inside the transfer (a 128 MiB push took 2x longer), but makes
  // the whole region resident at once, however much of it is ever used.
  void* map = mmap(nullptr, map_len, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, static_cast<off_t>(map_off));
  int e = errno;
  close(fd);
  if (map == MAP_FAILED) {
    throw MakeError(env, "ERR_FILE", "mapFile: cannot map '" + path + "': " + std::strerror(e));
  }
  uint8_t* base = static_cast<uint8_t*>(map) + (offset - map_off);
  ucp_mem_h memh = nullptr;
  ucs_status_t status = RegisterRange(base, length, &memh, MemKind::kHost);
  if (status != UCS_OK) {
    munmap(map, map_len);
    throw UcsError(env, "ucp_mem_map failed for '" + path + "'", status);
  }
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  region->InitFile(map, map_len, base, length, memh, path);
  return obj;
}

// allocate(length, populate): memory allocated and registered by UCX. On one host this
// lets the shared-memory transports copy with plain loads and stores instead of
// a system call per operation (what ucx_perftest measures by default).
Napi::Value AgentWrap::Allocate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "allocate");
  if (info.Length() < 1 || !info[0].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT", "allocate(length) expects a number");
  }
  double len_d = info[0].As<Napi::Number>().DoubleValue();
  if (!(len_d > 0) || std::floor(len_d) != len_d || len_d > 9007199254740992.0) {
    throw MakeError(env, "ERR_INVALID_LENGTH", "allocate: length must be a positive integer",
                    UCS_OK, true);
  }
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.memory_type = UCS_MEMORY_TYPE_HOST;
  params.address = nullptr;
  params.length = static_cast<size_t>(len_d);
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t status = ucp_mem_map(engine_->context(), &params, &memh);
  if (status != UCS_OK) throw UcsError(env, "allocate: ucp_mem_map failed", status);
  ucp_mem_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  status = ucp_mem_query(memh, &attr);
  if (status != UCS_OK) {
    ucp_mem_unmap(engine_->context(), memh);
    throw UcsError(env, "allocate: ucp_mem_query failed", status);
  }
  // UCX 1.13 allocates from its sysv memory domain first: a SysV segment, already marked for
  // removal, that another process of this user can attach by its id (the engine, to compute
  // into the KV that this region is). UCX creates it group-accessible; narrow it to the owner.
  int segment = FindSegment(attr.address);
  if (segment >= 0) {
    if (int e = MakeOwnerOnly(segment); e != 0) {
      ucp_mem_unmap(engine_->context(), memh);
      throw MakeError(env, "ERR_SEGMENT",
                      "allocate: cannot make segment " + std::to_string(segment) +
                          " owner-only: " + std::strerror(e));
    }
  }
  // populate: fault every page in now, as mapFile's populate does for a file.
  if (info.Length() >= 2 && info[1].ToBoolean().Value()) PopulateWrite(attr.address, params.length);
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  region->InitAllocated(static_cast<uint8_t*>(attr.address), params.length, memh, segment);
  return obj;
}

// attachSegment(shmid, length): a SysV shared-memory segment of this process's user, owner-only
// (mode 0600, as allocate() leaves the segments it makes), attached and registered. The engine
// computes into a region its sidecar allocated this way; a restarted sidecar takes over the
// segments of an engine that registers again.
Napi::Value AgentWrap::AttachSegment(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "attachSegment");
  if (info.Length() < 2 || !info[0].IsNumber() || !info[1].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT", "attachSegment(id, length) expects two numbers");
  }
  double id_d = info[0].As<Napi::Number>().DoubleValue();
  double len_d = info[1].As<Napi::Number>().DoubleValue();
  if (!(id_d >= 0) || std::floor(id_d) != id_d || id_d > 2147483647.0) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "attachSegment: the segment id must be a non-negative integer", UCS_OK, true);
  }
  if (!(len_d > 0) || std::floor(len_d) != len_d || len_d > 9007199254740992.0) {
    throw MakeError(env, "ERR_INVALID_LENGTH", "attachSegment: length must be a positive integer",
                    UCS_OK, true);
  }
  const int id = static_cast<int>(id_d);
  const uint64_t length = static_cast<uint64_t>(len_d);
  const std::string name = "segment " + std::to_string(id);
  void* addr = AttachOwnerOnly(env, id, length, name);
  ucp_mem_h memh = nullptr;
  ucs_status_t status = RegisterRange(addr, length, &memh, MemKind::kHost);
  if (status != UCS_OK) {
    shmdt(addr);
    throw UcsError(env, "ucp_mem_map failed for " + name, status);
  }
  Napi::Object obj;
  RegionWrap* region = NewRegion(env, &obj);
  region->InitSegment(addr, length, memh, id);
  return obj;
}

}  // namespace kvxfer
