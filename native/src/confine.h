// File confinement for mapFile: a path opened only where the operator's KV directory allows, with
// no symbolic link, foreign owner or second hard link on the way (the reasons OpenConfined gives).
#pragma once

#include <napi.h>

#include <string>

namespace kvxfer {

// Opens `path` read-write for mapping, confined to the directory `dir` (absolute): the path must
// be absolute, have no ".." component, lie under `dir`, and be reached from `dir` without a
// symbolic link at any step (each component opened with O_NOFOLLOW relative to its parent's
// descriptor, so nothing can be swapped in between a check and the open). Every directory below
// `dir` and the file must be owned by this process's effective uid; the file must be a regular
// file with one link. The checks are made with fstat on the descriptors actually opened; the
// one returned is the one mapped. `dir` itself is the operator's setting and is opened as given.
// Refusals are thrown as JavaScript errors (ERR_REGION_OUTSIDE, ERR_REGION_SYMLINK, ...).
int OpenConfined(Napi::Env env, const std::string& path, const std::string& dir);

}  // namespace kvxfer
