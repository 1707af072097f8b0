// File confinement (confine.h): a path walked one component at a time from the KV directory,
// each opened relative to its parent without following links, and checked on what was opened.
#include "confine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "wire.h"

namespace kvxfer {

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

}  // namespace

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

}  // namespace kvxfer
