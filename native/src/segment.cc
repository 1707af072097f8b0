// SysV shared-memory segments (segment.h): found through /proc/self/maps, narrowed to their owner,
// checked and attached.
#include "segment.h"

#include <sys/shm.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "wire.h"

namespace kvxfer {

int FindSegment(const void* addr) {
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

int MakeOwnerOnly(int id) {
  struct shmid_ds ds;
  std::memset(&ds, 0, sizeof(ds));
  if (shmctl(id, IPC_STAT, &ds) != 0 ||
      (ds.shm_perm.mode = static_cast<unsigned short>(0600), shmctl(id, IPC_SET, &ds) != 0)) {
    return errno;
  }
  return 0;
}

void* AttachOwnerOnly(Napi::Env env, int id, uint64_t length, const std::string& name) {
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
  return addr;
}

}  // namespace kvxfer
