#include "agent.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "region.h"
#include "remote_region.h"
#include "ucx_status.h"
#include "wire.h"
#include "xfer.h"

namespace kvxfer {

Napi::Function AgentWrap::Define(Napi::Env env) {
  return DefineClass(env, "Agent",
                     {
                         InstanceAccessor<&AgentWrap::Address>("address"),
                         InstanceAccessor<&AgentWrap::Name>("name"),
                         InstanceAccessor<&AgentWrap::Inflight>("inflight"),
                         InstanceAccessor<&AgentWrap::Transports>("transports"),
                         InstanceAccessor<&AgentWrap::MemoryTypes>("memoryTypes"),
                         InstanceMethod<&AgentWrap::RegisterMemory>("registerMemory"),
                         InstanceMethod<&AgentWrap::RegisterAddress>("registerAddress"),
                         InstanceMethod<&AgentWrap::OpenCudaIpc>("openCudaIpc"),
                         InstanceMethod<&AgentWrap::AllocateCuda>("allocateCuda"),
                         InstanceMethod<&AgentWrap::MapFile>("mapFile"),
                         InstanceMethod<&AgentWrap::Allocate>("allocate"),
                         InstanceMethod<&AgentWrap::AttachSegment>("attachSegment"),
                         InstanceMethod<&AgentWrap::Connect>("connect"),
                         InstanceMethod<&AgentWrap::Transfer>("transfer"),
                         InstanceMethod<&AgentWrap::TransferMany>("transferMany"),
                         InstanceMethod<&AgentWrap::Prepare>("prepare"),
                         InstanceMethod<&AgentWrap::Progress>("progress"),
                         InstanceMethod<&AgentWrap::WriteParts>("writeParts"),
                         InstanceMethod<&AgentWrap::Notify>("notify"),
                         InstanceMethod<&AgentWrap::Close>("close"),
                         InstanceMethod<&AgentWrap::BeginClose>("beginClose"),
                     });
}

// new Agent({ name, transports, netDevices, busyPoll, maxNotificationBytes }, onEvents)
AgentWrap::AgentWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<AgentWrap>(info) {
  Napi::Env env = info.Env();
  data_ = env.GetInstanceData<AddonData>();
  if (info.Length() < 2 || !info[0].IsObject() || !info[1].IsFunction()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "Agent(options, onEvents) expects an object and a function");
  }
  Napi::Object o = info[0].As<Napi::Object>();
  EngineOptions opts;
  auto str = [&](const char* key) -> std::string {
    Napi::Value v = o.Get(key);
    return v.IsString() ? v.As<Napi::String>().Utf8Value() : std::string();
  };
  opts.name = str("name");
  opts.transports = str("transports");
  opts.net_devices = str("netDevices");
  opts.busy_poll = o.Get("busyPoll").ToBoolean().Value();
  opts.caller_progress = str("progress") == "caller";
  Napi::Value spin = o.Get("spinUs");
  if (spin.IsNumber() && spin.As<Napi::Number>().Int64Value() > 0) {
    opts.spin_after_activity = std::chrono::microseconds(spin.As<Napi::Number>().Int64Value());
  }
  Napi::Value maxn = o.Get("maxNotificationBytes");
  if (maxn.IsNumber()) opts.max_notification_bytes = maxn.As<Napi::Number>().Int64Value();

  ucs_status_t status = UCS_OK;
  std::string what;
  engine_ = ProgressEngine::Create(opts, &status, &what);
  if (!engine_) throw UcsError(env, "cannot create UCX agent: " + what, status);

  on_event_ = Napi::Persistent(info[1].As<Napi::Function>());
  link_ = std::make_shared<AgentLink>();
  link_->agent = this;
  tsfn_ = Napi::ThreadSafeFunction::New(
      env, Napi::Function::New(env, [](const Napi::CallbackInfo&) {}), "kvxfer-progress", 0, 1);
  tsfn_.Unref(env);
  auto link = link_;
  Napi::ThreadSafeFunction tsfn = tsfn_;
  engine_->Start([tsfn, link]() mutable {
    tsfn.NonBlockingCall([link](Napi::Env env, Napi::Function) {
      if (link->agent != nullptr) link->agent->Deliver(env);
    });
  });
  data_->agents.insert(this);
}

AgentWrap::~AgentWrap() {
  if (state_ != HandleState::kClosed) CloseAll(Env(), false);
}

void AgentWrap::CheckOpen(Napi::Env env, const char* what) {
  if (state_ != HandleState::kOpen) {
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the agent is closed");
  }
}

Napi::Value AgentWrap::Address(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "address");
  std::vector<uint8_t> blob = WrapAddress(engine_->worker_address());
  return Napi::Buffer<uint8_t>::Copy(info.Env(), blob.data(), blob.size());
}

Napi::Value AgentWrap::Name(const Napi::CallbackInfo& info) {
  return Napi::String::New(info.Env(), engine_ ? engine_->name() : std::string());
}

Napi::Value AgentWrap::Inflight(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(pending_.size()));
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

Napi::Value AgentWrap::Transports(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "transports");
  return StringArray(info.Env(), engine_->context_info().resources);
}

Napi::Value AgentWrap::MemoryTypes(const Napi::CallbackInfo& info) {
  CheckOpen(info.Env(), "memoryTypes");
  return StringArray(info.Env(), MemoryTypeNames(engine_->context_info().memory_types));
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

namespace {

// A file descriptor closed when it goes out of scope (errors below are thrown).
struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() {
    int f = fd;
    fd = -1;
    return f;
  }
};

std::vector<std::string> PathComponents(const std::string& path) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    std::string c = path.substr(i, j - i);
    if (!c.empty() && c != ".") out.push_back(c);
    i = j + 1;
  }
  return out;
}

const char* FileKind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

// Opens `path` read-write for mapping, confined to the directory `dir` (absolute): the path must
// be absolute, have no ".." component, lie under `dir`, and be reached from `dir` without a
// symbolic link at any step (each component opened with O_NOFOLLOW relative to its parent's
// descriptor, so nothing can be swapped in between a check and the open). Every directory below
// `dir` and the file must be owned by this process's effective uid; the file must be a regular
// file with one link. The checks are made with fstat on the descriptors actually opened; the
// one returned is the one mapped. `dir` itself is the operator's setting and is opened as given.
int OpenConfined(Napi::Env env, const std::string& path, const std::string& dir) {
  auto refuse = [&](const std::string& code, const std::string& why) {
    return MakeError(env, code, "'" + path + "' " + why);
  };
  if (path.empty() || path[0] != '/') throw refuse("ERR_REGION_OUTSIDE", "is not an absolute path");
  std::vector<std::string> comps = PathComponents(path);
  for (const std::string& c : comps) {
    if (c == "..") throw refuse("ERR_REGION_OUTSIDE", "has a '..' component");
  }
  std::vector<std::string> base = PathComponents(dir);
  bool under = comps.size() > base.size();
  for (size_t i = 0; under && i < base.size(); ++i) under = comps[i] == base[i];
  if (!under) throw refuse("ERR_REGION_OUTSIDE", "is not under the KV directory '" + dir + "'");
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.fd < 0) {
    int e = errno;
    throw MakeError(env, "ERR_FILE",
                    "cannot open the KV directory '" + dir + "': " + std::strerror(e));
  }
  uid_t uid = geteuid();
  std::string walked = dir;
  // Explains why openat(O_NOFOLLOW) of `name` under `parent` failed with `e`.
  auto why_not = [&](int parent, const std::string& name, const std::string& at, int e) {
    struct stat ls;
    if (fstatat(parent, name.c_str(), &ls, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(ls.st_mode)) {
      return refuse("ERR_REGION_SYMLINK",
                    "is reached through a symbolic link ('" + at + "'); links are not followed");
    }
    if (e == ENOENT) {
      return MakeError(env, "ERR_NO_SUCH_FILE",
                       "mapFile: cannot open '" + path + "': " + std::strerror(e));
    }
    if (e == ENOTDIR) return refuse("ERR_REGION_NOT_REGULAR", "'" + at + "' is not a directory");
    return MakeError(env, "ERR_FILE",
                     "mapFile: cannot open '" + at + "' of '" + path + "': " + std::strerror(e));
  };
  Fd cur(dfd.release());
  for (size_t i = base.size(); i + 1 < comps.size(); ++i) {
    walked += "/" + comps[i];
    Fd next(openat(cur.fd, comps[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (next.fd < 0) throw why_not(cur.fd, comps[i], walked, errno);
    struct stat st;
    if (fstat(next.fd, &st) != 0) {
      int e = errno;
      throw MakeError(env, "ERR_FILE",
                      "mapFile: cannot stat '" + walked + "': " + std::strerror(e));
    }
    if (st.st_uid != uid) {
      throw refuse("ERR_REGION_OWNER", "is under the directory '" + walked + "', owned by uid " +
                                           std::to_string(st.st_uid) + ", not this uid " +
                                           std::to_string(uid));
    }
    std::swap(cur.fd, next.fd);
  }
  const std::string& name = comps.back();
  // O_PATH first: nothing is opened for I/O (no FIFO, device or terminal side effect) before
  // the type and owner are known.
  Fd probe(openat(cur.fd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (probe.fd < 0) throw why_not(cur.fd, name, path, errno);
  struct stat ps;
  if (fstat(probe.fd, &ps) != 0) {
    int e = errno;
    throw MakeError(env, "ERR_FILE", "mapFile: cannot stat '" + path + "': " + std::strerror(e));
  }
  auto check = [&](const struct stat& st) {
    if (S_ISLNK(st.st_mode)) {
      throw refuse("ERR_REGION_SYMLINK", "is a symbolic link; links are not followed");
    }
    if (!S_ISREG(st.st_mode)) {
      throw refuse("ERR_REGION_NOT_REGULAR",
                   std::string("is ") + FileKind(st.st_mode) + ", not a regular file");
    }
    if (st.st_uid != uid) {
      throw refuse("ERR_REGION_OWNER", "is owned by uid " + std::to_string(st.st_uid) +
                                           ", not this uid " + std::to_string(uid));
    }
    if (st.st_nlink != 1) {
      throw refuse("ERR_REGION_NOT_REGULAR",
                   "has " + std::to_string(st.st_nlink) + " hard links (one expected)");
    }
  };
  check(ps);
  Fd fd(openat(cur.fd, name.c_str(), O_RDWR | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK | O_CLOEXEC));
  if (fd.fd < 0) throw why_not(cur.fd, name, path, errno);
  struct stat st;
  if (fstat(fd.fd, &st) != 0) {
    int e = errno;
    throw MakeError(env, "ERR_FILE", "mapFile: cannot stat '" + path + "': " + std::strerror(e));
  }
  if (st.st_dev != ps.st_dev || st.st_ino != ps.st_ino) {
    throw refuse("ERR_REGION_CHANGED", "was replaced while being opened");
  }
  check(st);
  return fd.release();
}

}  // namespace

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
    struct shmid_ds ds;
    std::memset(&ds, 0, sizeof(ds));
    if (shmctl(segment, IPC_STAT, &ds) != 0 ||
        (ds.shm_perm.mode = static_cast<unsigned short>(0600),
         shmctl(segment, IPC_SET, &ds) != 0)) {
      int e = errno;
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

// The id of the SysV shared-memory segment mapped at `addr` in this process, or -1. Linux
// lists an attached segment in /proc/self/maps as "/SYSV<key>" with the segment's id as inode.
int AgentWrap::FindSegment(const void* addr) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms, offset, dev, path;
    unsigned long long inode = 0;
    if (!(in >> range >> perms >> offset >> dev >> inode)) continue;
    std::getline(in >> std::ws, path);
    size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (a < lo || a >= hi) continue;
    if (path.rfind("/SYSV", 0) != 0 || inode > 0x7fffffffULL) return -1;
    return static_cast<int>(inode);
  }
  return -1;
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
  struct shmid_ds ds;
  std::memset(&ds, 0, sizeof(ds));
  if (shmctl(id, IPC_STAT, &ds) != 0) {
    int e = errno;
    throw MakeError(env, e == EACCES ? "ERR_SEGMENT_PERMISSIONS" : "ERR_NO_SUCH_SEGMENT",
                    "attachSegment: " + name + ": " + std::strerror(e));
  }
  if (ds.shm_perm.uid != geteuid()) {
    throw MakeError(env, "ERR_SEGMENT_PERMISSIONS",
                    "attachSegment: " + name + " belongs to uid " +
                        std::to_string(ds.shm_perm.uid) + ", not to this process's uid " +
                        std::to_string(geteuid()));
  }
  if ((ds.shm_perm.mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", ds.shm_perm.mode & 0777);
    throw MakeError(env, "ERR_SEGMENT_PERMISSIONS",
                    "attachSegment: " + name + " has mode " + mode +
                        "; only an owner-only segment (0600) is accepted");
  }
  if (length > static_cast<uint64_t>(ds.shm_segsz)) {
    throw MakeError(env, "ERR_OUT_OF_BOUNDS",
                    "attachSegment: length " + std::to_string(length) + " exceeds " + name + " (" +
                        std::to_string(ds.shm_segsz) + " bytes)",
                    UCS_OK, true);
  }
  void* addr = shmat(id, nullptr, 0);
  if (addr == reinterpret_cast<void*>(-1)) {
    int e = errno;
    throw MakeError(env, e == EACCES ? "ERR_SEGMENT_PERMISSIONS" : "ERR_SEGMENT",
                    "attachSegment: cannot attach " + name + ": " + std::strerror(e));
  }
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

// connect(addressBlob, errorMode: "none" | "peer")
Napi::Value AgentWrap::Connect(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "connect");
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (info.Length() < 1 || !BytesOf(info[0], &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT", "connect expects the peer's address as a Buffer");
  }
  bool peer_mode = false;
  if (info.Length() >= 2 && info[1].IsString()) {
    std::string mode = info[1].As<Napi::String>().Utf8Value();
    if (mode == "peer") {
      peer_mode = true;
    } else if (mode != "none") {
      throw MakeError(env, "ERR_INVALID_ARGUMENT",
                      "connect: errorMode must be 'none' or 'peer', got '" + mode + "'");
    }
  }
  std::vector<uint8_t> raw;
  if (!UnwrapAddress(data, size, &raw)) {
    throw MakeError(env, "ERR_BAD_ADDRESS",
                    "connect: not a kvxfer worker address (bad magic, length or checksum; " +
                        std::to_string(size) + " bytes)");
  }
  std::shared_ptr<EndpointCore> core;
  ucs_status_t status = engine_->CreateEndpoint(raw, peer_mode, &core);
  if (status != UCS_OK) throw UcsError(env, "connect: ucp_ep_create failed", status);
  Napi::Object obj = data_->endpoint_ctor.New({Napi::Number::New(env, kCtorToken)});
  EndpointWrap* ep = EndpointWrap::Unwrap(obj);
  ep->core_ = core;
  Adopt(ep);
  Register(ep);
  return obj;
}

namespace {

constexpr double kMaxSafe = 9007199254740992.0;  // 2^53

// Reads and checks the descriptor array into `out`. The check and the use
// must see the same bytes, so the progress thread gets a validated copy, not
// a pointer into memory JavaScript could still change.
// `where` leads every message (e.g. "writeParts part 2: "), naming the part of a call at fault.
void ReadDescriptors(Napi::Env env, const Napi::Value& v, uint64_t local_len, uint64_t remote_len,
                     std::vector<uint64_t>* out, const std::string& where = "") {
  const double* doubles = nullptr;
  const uint64_t* words = nullptr;
  size_t count = 0;
  if (v.IsTypedArray()) {
    auto ta = v.As<Napi::TypedArray>();
    const uint8_t* p = static_cast<const uint8_t*>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
    switch (ta.TypedArrayType()) {
      case napi_float64_array:
        doubles = reinterpret_cast<const double*>(p);
        count = ta.ElementLength();
        break;
      case napi_biguint64_array:
        words = reinterpret_cast<const uint64_t*>(p);
        count = ta.ElementLength();
        break;
      case napi_uint8_array:
        // Raw little-endian float64 triples, e.g. straight off a wire message.
        if (reinterpret_cast<uintptr_t>(p) % 8 != 0) {
          throw MakeError(env, "ERR_DESC_MISALIGNED",
                          where +
                              "descriptors: byte view must start on an 8-byte boundary (offset " +
                              std::to_string(ta.ByteOffset()) + ")",
                          UCS_OK, true);
        }
        if (ta.ByteLength() % 8 != 0) {
          throw MakeError(env, "ERR_DESC_TRUNCATED",
                          where + "descriptors: byte length " + std::to_string(ta.ByteLength()) +
                              " is not a whole number of float64 values",
                          UCS_OK, true);
        }
        doubles = reinterpret_cast<const double*>(p);
        count = ta.ByteLength() / 8;
        break;
      default:
        throw MakeError(env, "ERR_DESC_TYPE",
                        where +
                            "descriptors must be a Float64Array, BigUint64Array or Uint8Array of "
                            "(localOffset, remoteOffset, length) triples",
                        UCS_OK, true);
    }
  } else {
    throw MakeError(
        env, "ERR_DESC_TYPE",
        where + "descriptors must be a Float64Array of (localOffset, remoteOffset, length) triples",
        UCS_OK, true);
  }
  if (count % 3 != 0) {
    throw MakeError(env, "ERR_DESC_TRUNCATED",
                    where + "descriptors: " + std::to_string(count) +
                        " values is not a whole number of triples",
                    UCS_OK, true);
  }
  out->resize(count);
  static const char* kField[3] = {"localOffset", "remoteOffset", "length"};
  for (size_t i = 0; i < count; ++i) {
    uint64_t value;
    if (doubles) {
      double d = doubles[i];
      if (!(d >= 0) || d > kMaxSafe || std::floor(d) != d) {
        bool len = i % 3 == 2;
        throw MakeError(env, len ? "ERR_INVALID_LENGTH" : "ERR_INVALID_OFFSET",
                        where + "descriptor " + std::to_string(i / 3) + ": " + kField[i % 3] + " " +
                            std::to_string(d) + " is not a non-negative integer",
                        UCS_OK, true);
      }
      value = static_cast<uint64_t>(d);
    } else {
      value = words[i];
    }
    (*out)[i] = value;
  }
  for (size_t t = 0; t < count / 3; ++t) {
    uint64_t lo = (*out)[3 * t], ro = (*out)[3 * t + 1], len = (*out)[3 * t + 2];
    if (len == 0) {
      throw MakeError(env, "ERR_INVALID_LENGTH",
                      where + "descriptor " + std::to_string(t) + ": length is zero", UCS_OK, true);
    }
    if (lo > local_len || len > local_len - lo) {
      throw MakeError(env, "ERR_OUT_OF_BOUNDS",
                      where + "descriptor " + std::to_string(t) + ": local range [" +
                          std::to_string(lo) + ", " + std::to_string(lo + len) +
                          ") exceeds the local region (" + std::to_string(local_len) + " bytes)",
                      UCS_OK, true);
    }
    if (ro > remote_len || len > remote_len - ro) {
      throw MakeError(env, "ERR_OUT_OF_BOUNDS",
                      where + "descriptor " + std::to_string(t) + ": remote range [" +
                          std::to_string(ro) + ", " + std::to_string(ro + len) +
                          ") exceeds the remote region (" + std::to_string(remote_len) + " bytes)",
                      UCS_OK, true);
    }
  }
}

template <typename W>
W* UnwrapHandle(Napi::Env env, const Napi::Value& v, const napi_type_tag& tag, const char* what) {
  if (!HasTag(env, v, tag)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    std::string(what) + " is not a kvxfer handle of the right kind");
  }
  return W::Unwrap(v.As<Napi::Object>());
}

}  // namespace

void AgentWrap::AddSegment(Napi::Env env, const char* what, const std::string& where,
                           EndpointWrap* ep, const Napi::Value& local_v,
                           const Napi::Value& remote_v, const Napi::Value& descs, TransferOp* op,
                           std::vector<RegionWrap*>* locals, std::vector<RemoteWrap*>* remotes) {
  auto* local = UnwrapHandle<RegionWrap>(env, local_v, kRegionTag, "local region");
  auto* remote = UnwrapHandle<RemoteWrap>(env, remote_v, kRemoteTag, "remote region");
  if (local->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the local region is closed");
  if (remote->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the remote region is closed");
  if (local->agent_ != this || remote->agent_ != this) {
    throw MakeError(env, "ERR_WRONG_AGENT",
                    std::string(what) + ": a handle belongs to another agent");
  }
  if (remote->ep_ != ep->core_) {
    throw MakeError(env, "ERR_ENDPOINT_MISMATCH",
                    std::string(what) + ": the remote region was imported on another endpoint");
  }
  std::vector<uint64_t> d;
  ReadDescriptors(env, descs, local->length(), remote->length_, &d, where);
  // The operation holds every handle it names, even one with nothing to move.
  locals->push_back(local);
  remotes->push_back(remote);
  if (d.empty()) return;  // nothing to move for this pair: no segment (segments are never empty)
  op->desc.insert(op->desc.end(), d.begin(), d.end());
  TransferOp::Segment sg;
  sg.local_base = local->base();
  sg.local_memh = local->memh();
  sg.remote_base = remote->address_;
  sg.rkey = remote->rkey_;
  sg.end = op->desc.size() / 3;
  op->segs.push_back(sg);
}

EndpointWrap* AgentWrap::OpenEndpoint(Napi::Env env, const Napi::Value& v, const char* what) {
  auto* ep = UnwrapHandle<EndpointWrap>(env, v, kEndpointTag, "endpoint");
  if (ep->state_ != HandleState::kOpen)
    throw MakeError(env, "ERR_CLOSED", std::string(what) + ": the endpoint is closed");
  if (ep->agent_ != this)
    throw MakeError(env, "ERR_WRONG_AGENT",
                    std::string(what) + ": the endpoint belongs to another agent");
  return ep;
}

void AgentWrap::SetNotification(Napi::Env env, const char* what, const Napi::Value& v,
                                TransferOp* op) {
  const uint8_t* data = nullptr;
  size_t size = 0;
  if (!BytesOf(v, &data, &size)) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    std::string(what) + ": notification must be a Buffer or Uint8Array");
  }
  if (size > engine_->max_notification_bytes()) {
    throw MakeError(env, "ERR_NOTIFICATION_TOO_LARGE",
                    "notification of " + std::to_string(size) + " bytes exceeds the limit of " +
                        std::to_string(engine_->max_notification_bytes()),
                    UCS_OK, true);
  }
  op->notification.assign(data, data + size);
  op->has_notification = true;
}

// One write or read from its arguments (kind: 0 write | 1 read, endpoint, local, remote,
// descriptors, notification?), checked completely; `what` leads its errors.
AgentWrap::Built AgentWrap::BuildTransfer(Napi::Env env, const std::string& what,
                                          const Napi::Value* args, size_t n) {
  if (n < 5 || !args[0].IsNumber()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    what + "(kind, endpoint, local, remote, descriptors, notification?)");
  }
  int kind = args[0].As<Napi::Number>().Int32Value();
  if (kind != 0 && kind != 1)
    throw MakeError(env, "ERR_INVALID_ARGUMENT", what + ": kind must be 0 (write) or 1 (read)");
  Built b;
  b.ep = OpenEndpoint(env, args[1], what.c_str());
  b.op = std::make_unique<TransferOp>();
  AddSegment(env, what.c_str(), what == "transfer" ? "" : what + ": ", b.ep, args[2], args[3],
             args[4], b.op.get(), &b.locals, &b.remotes);
  if (n >= 6 && !args[5].IsUndefined() && !args[5].IsNull()) {
    if (kind != 0)
      throw MakeError(env, "ERR_INVALID_ARGUMENT", what + ": only a write carries a notification");
    SetNotification(env, what.c_str(), args[5], b.op.get());
  }
  if (b.ep->core_->failed.load()) {
    throw UcsError(env, what + ": the endpoint has failed", b.ep->core_->fail_status);
  }
  b.op->kind = kind == 0 ? OpKind::kWrite : OpKind::kRead;
  b.op->ep = b.ep->core_;
  return b;
}

RegionWrap* AgentWrap::NewRegion(Napi::Env env, Napi::Object* obj) {
  *obj = data_->region_ctor.New({Napi::Number::New(env, kCtorToken)});
  RegionWrap* region = RegionWrap::Unwrap(*obj);
  Adopt(region);
  return region;
}

AgentWrap::Built AgentWrap::BuildTransfer(const Napi::CallbackInfo& info, const std::string& what) {
  Napi::Value args[6];
  const size_t n = std::min<size_t>(info.Length(), 6);
  for (size_t i = 0; i < n; ++i) args[i] = info[i];
  return BuildTransfer(info.Env(), what, args, n);
}

// transfer(kind: 0 write | 1 read, endpoint, localRegion, remoteRegion, descriptors, notification?)
Napi::Value AgentWrap::Transfer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "transfer");
  Built b = BuildTransfer(info, "transfer");
  Napi::Value promise = Track(env, b.op.get(), b.ep, std::move(b.locals), std::move(b.remotes));
  engine_->Submit(std::move(b.op));
  return promise;
}

// transferMany([[kind, endpoint, local, remote, descriptors, notification?], ...]): every entry
// checked first (a bad one refuses them all, naming it, before anything is posted), then all
// handed to the progress thread in one command and one wake-up. Returns one promise per entry.
Napi::Value AgentWrap::TransferMany(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "transferMany");
  if (info.Length() < 1 || !info[0].IsArray()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "transferMany([[kind, endpoint, local, remote, descriptors, notification?], "
                    "...])");
  }
  Napi::Array entries = info[0].As<Napi::Array>();
  const uint32_t count = entries.Length();
  std::vector<Built> built;
  built.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    Napi::Value e = entries.Get(i);
    const std::string what = "transferMany entry " + std::to_string(i);
    if (!e.IsArray()) throw MakeError(env, "ERR_INVALID_ARGUMENT", what + " is not an array");
    Napi::Array a = e.As<Napi::Array>();
    Napi::Value args[6];
    const size_t n = std::min<uint32_t>(a.Length(), 6);
    for (uint32_t k = 0; k < n; ++k) args[k] = a.Get(k);
    built.push_back(BuildTransfer(env, what, args, n));
  }
  Napi::Array promises = Napi::Array::New(env, count);
  std::vector<std::unique_ptr<TransferOp>> ops;
  ops.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    Built& b = built[i];
    promises.Set(i, Track(env, b.op.get(), b.ep, std::move(b.locals), std::move(b.remotes)));
    ops.push_back(std::move(b.op));
  }
  if (!ops.empty()) engine_->SubmitMany(std::move(ops));
  return promises;
}

// prepare(kind, endpoint, local, remote, descriptors, notification?): the transfer checked once,
// as transfer() checks it, and kept as a PreparedTransfer to post() again and again.
Napi::Value AgentWrap::Prepare(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "prepare");
  Built b = BuildTransfer(info, "prepare");
  b.op->id = next_op_id_++;
  Napi::Object obj = data_->xfer_ctor.New({Napi::Number::New(env, kCtorToken)});
  XferWrap* x = XferWrap::Unwrap(obj);
  x->Init(env, std::move(b.op), b.ep, std::move(b.locals), std::move(b.remotes));
  Adopt(x);
  return obj;
}

void AgentWrap::PostPrepared(Napi::Env env, std::unique_ptr<TransferOp> op) {
  ++prepared_posted_;
  UpdateRef(env);
  engine_->Submit(std::move(op));
}

// progress(): in caller-progress mode, posts what is queued, progresses the worker until idle and
// delivers what completed (promises settled, notifications to onEvents), all on this thread.
// Returns the number of operations settled. In the default mode it only delivers what the
// progress thread has queued.
Napi::Value AgentWrap::Progress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (state_ != HandleState::kOpen || !engine_) return Napi::Number::New(env, 0);
  if (engine_->caller_progress()) engine_->Progress();
  return Napi::Number::New(env, static_cast<double>(Deliver(env)));
}

// writeParts(endpoint, [[localRegion, remoteRegion, descriptors], ...], notification?): every
// part's puts in order, one flush, then the notification if any: one operation (one hand-off to
// the progress thread, one completion back) for all of a rank pair's region pairs.
Napi::Value AgentWrap::WriteParts(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "writeParts");
  if (info.Length() < 2 || !info[1].IsArray()) {
    throw MakeError(env, "ERR_INVALID_ARGUMENT",
                    "writeParts(endpoint, [[local, remote, descriptors], ...], notification?)");
  }
  EndpointWrap* ep = OpenEndpoint(env, info[0], "writeParts");
  auto op = std::make_unique<TransferOp>();
  std::vector<RegionWrap*> locals;
  std::vector<RemoteWrap*> remotes;
  Napi::Array parts = info[1].As<Napi::Array>();
  for (uint32_t i = 0; i < parts.Length(); ++i) {
    Napi::Value part = parts.Get(i);
    if (!part.IsArray() || part.As<Napi::Array>().Length() != 3) {
      throw MakeError(env, "ERR_INVALID_ARGUMENT",
                      "writeParts: part " + std::to_string(i) +
                          " is not a [local, remote, descriptors] triple");
    }
    Napi::Array p = part.As<Napi::Array>();
    const std::string what = "writeParts part " + std::to_string(i);
    AddSegment(env, what.c_str(), what + ": ", ep, p.Get(0u), p.Get(1u), p.Get(2u), op.get(),
               &locals, &remotes);
  }
  if (info.Length() >= 3 && !info[2].IsUndefined() && !info[2].IsNull())
    SetNotification(env, "writeParts", info[2], op.get());
  if (ep->core_->failed.load()) {
    throw UcsError(env, "writeParts: the endpoint has failed", ep->core_->fail_status);
  }
  op->kind = OpKind::kWrite;
  op->ep = ep->core_;
  Napi::Value promise = Track(env, op.get(), ep, std::move(locals), std::move(remotes));
  engine_->Submit(std::move(op));
  return promise;
}

// notify(endpoint, bytes)
Napi::Value AgentWrap::Notify(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  CheckOpen(env, "notify");
  if (info.Length() < 2) throw MakeError(env, "ERR_INVALID_ARGUMENT", "notify(endpoint, bytes)");
  EndpointWrap* ep = OpenEndpoint(env, info[0], "notify");
  auto op = std::make_unique<TransferOp>();
  SetNotification(env, "notify", info[1], op.get());
  if (ep->core_->failed.load())
    throw UcsError(env, "notify: the endpoint has failed", ep->core_->fail_status);
  op->kind = OpKind::kNotify;
  op->ep = ep->core_;
  Napi::Value promise = Track(env, op.get(), ep, {}, {});
  engine_->Submit(std::move(op));
  return promise;
}

Napi::Value AgentWrap::Track(Napi::Env env, TransferOp* op, EndpointWrap* ep,
                             std::vector<RegionWrap*> locals, std::vector<RemoteWrap*> remotes) {
  uint64_t id = next_op_id_++;
  op->id = id;
  auto pending = std::make_unique<Pending>(env);
  pending->kind = op->kind;
  pending->held.Hold(ep, std::move(locals), std::move(remotes));
  Napi::Promise promise = pending->deferred.Promise();
  pending_[id] = std::move(pending);
  UpdateRef(env);
  return promise;
}

void AgentWrap::UpdateRef(Napi::Env env) {
  // Keep the process alive while transfers are in flight, not while idle.
  bool want = (!pending_.empty() || prepared_posted_ > 0) && state_ == HandleState::kOpen;
  if (want != tsfn_ref_) {
    if (want) {
      tsfn_.Ref(env);
    } else {
      tsfn_.Unref(env);
    }
    tsfn_ref_ = want;
  }
}

namespace {

// The operation's steps for JavaScript, in microseconds of CLOCK_MONOTONIC (0: not reached).
Napi::Float64Array TraceObject(Napi::Env env, const OpTrace& t, uint64_t delivered) {
  // A Float64Array of the eight steps in OpTrace's order (src/native/index.ts names them): one
  // allocation, where an object took a property set per step (the largest share of a polling
  // agent's CPU per 4 KiB request, measured with perf).
  Napi::Float64Array a = Napi::Float64Array::New(env, 8);
  const uint64_t values[] = {t.submitted, t.started,  t.first_post, t.posted,
                             t.flushed,   t.notified, t.completed,  delivered};
  for (size_t i = 0; i < 8; ++i) a[i] = static_cast<double>(values[i]);
  return a;
}

}  // namespace

void AgentWrap::Settle(Napi::Env env, const Event& ev, uint64_t delivered_us) {
  auto it = pending_.find(ev.id);
  if (it == pending_.end()) return;
  std::unique_ptr<Pending> p = std::move(it->second);
  pending_.erase(it);
  p->held.Release();
  if (ev.status == UCS_OK) {
    p->deferred.Resolve(TraceObject(env, ev.trace, delivered_us));
  } else if (ev.status == UCS_ERR_CANCELED &&
             (state_ != HandleState::kOpen || engine_->shutdown_requested())) {
    p->deferred.Reject(
        MakeError(env, "ERR_CLOSED", "transfer cancelled: the agent was closed").Value());
  } else {
    const char* what = p->kind == OpKind::kWrite  ? "write"
                       : p->kind == OpKind::kRead ? "read"
                                                  : "notify";
    p->deferred.Reject(UcsError(env, std::string(what) + " failed", ev.status).Value());
  }
}

size_t AgentWrap::Deliver(Napi::Env env) {
  if (!engine_) return 0;
  std::vector<Event>& events = delivering_;
  events.clear();
  engine_->TakeEvents(&events);
  if (events.empty()) return 0;
  size_t settled = 0;
  const uint64_t delivered_us = MonoUs();
  Napi::HandleScope scope(env);
  Napi::Array batch = Napi::Array::New(env);
  uint32_t n = 0;
  for (Event& ev : events) {
    switch (ev.kind) {
      case Event::Kind::kPrepared:
        --prepared_posted_;
        static_cast<XferWrap*>(ev.owner)->Returned(std::move(ev.op), ev.status);
        ++settled;
        break;
      case Event::Kind::kCompletion:
        Settle(env, ev, delivered_us);
        ++settled;
        break;
      case Event::Kind::kNotification: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "notification");
        o.Set("peer", Napi::String::New(env, ev.peer));
        o.Set("data", Napi::Buffer<uint8_t>::Copy(env, ev.bytes.data(), ev.bytes.size()));
        o.Set("receivedUs", Napi::Number::New(env, static_cast<double>(ev.received_us)));
        o.Set("deliveredUs", Napi::Number::New(env, static_cast<double>(delivered_us)));
        batch.Set(n++, o);
        break;
      }
      case Event::Kind::kDropped: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "notificationDropped");
        o.Set("peer", Napi::String::New(env, ev.peer));
        o.Set("bytes", Napi::Number::New(env, static_cast<double>(ev.id)));
        batch.Set(n++, o);
        break;
      }
      case Event::Kind::kEndpointFailed: {
        Napi::Object o = Napi::Object::New(env);
        o.Set("type", "endpointFailed");
        o.Set("endpointId", Napi::Number::New(env, static_cast<double>(ev.id)));
        o.Set("code", Napi::String::New(env, UcsStatusName(ev.status)));
        o.Set("ucsStatus", Napi::Number::New(env, static_cast<int>(ev.status)));
        batch.Set(n++, o);
        break;
      }
    }
  }
  UpdateRef(env);
  if (n > 0 && !on_event_.IsEmpty() && state_ == HandleState::kOpen) {
    on_event_.Call({batch});
  }
  return settled;
}

void AgentWrap::CloseAll(Napi::Env env, bool deliver) {
  if (state_ == HandleState::kClosed) return;
  state_ = HandleState::kClosing;
  data_->agents.erase(this);
  link_->agent = nullptr;
  // Stops the thread: queued transfers are cancelled, endpoints closed.
  engine_->Shutdown();
  if (deliver) {
    Deliver(env);
  } else {
    std::vector<Event> dropped;
    engine_->TakeEvents(&dropped);
  }
  pending_.clear();
  // The worker goes before the regions: purging its pending requests may touch their handles.
  engine_->DestroyWorker();
  std::vector<Child*> children(children_.begin(), children_.end());
  for (Child* c : children) c->CloseFromParent(deliver);
  children_.clear();
  endpoints_.clear();
  if (tsfn_ref_ && deliver) tsfn_.Unref(env);
  tsfn_ref_ = false;
  tsfn_.Release();
  engine_.reset();
  state_ = HandleState::kClosed;
}

Napi::Value AgentWrap::Close(const Napi::CallbackInfo& info) {
  CloseAll(info.Env(), true);
  return info.Env().Undefined();
}

// beginClose(): starts the shutdown (cancels what is queued, starts the deadline) without
// waiting; close() then waits for it.
Napi::Value AgentWrap::BeginClose(const Napi::CallbackInfo& info) {
  if (state_ == HandleState::kOpen && engine_) engine_->RequestShutdown();
  return info.Env().Undefined();
}

}  // namespace kvxfer
