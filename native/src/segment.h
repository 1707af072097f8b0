// SysV shared-memory segments: finding the one UCX allocated a region from, narrowing it to its
// owner, and attaching one another process of this user made (its checks and their refusals).
#pragma once

#include <napi.h>

#include <cstdint>
#include <string>

namespace kvxfer {

// The id of the SysV shared-memory segment mapped at `addr` in this process, or -1. Linux
// lists an attached segment in /proc/self/maps as "/SYSV<key>" with the segment's id as inode.
int FindSegment(const void* addr);

// Makes segment `id` owner-only (mode 0600). Returns 0, or the errno of the shmctl that failed.
int MakeOwnerOnly(int id);

// Attaches segment `id` (named `name` in errors) after checking that it belongs to this process's
// user, is owner-only (0600) and holds at least `length` bytes; returns where it is attached.
// Refusals are thrown: ERR_NO_SUCH_SEGMENT, ERR_SEGMENT_PERMISSIONS, ERR_OUT_OF_BOUNDS,
// ERR_SEGMENT.
void* AttachOwnerOnly(Napi::Env env, int id, uint64_t length, const std::string& name);

}  // namespace kvxfer
