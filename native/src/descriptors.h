// Descriptor parsing: the (localOffset, remoteOffset, length) triples of a transfer, read out of
// JavaScript and checked against both regions before anything is posted.
#pragma once

#include <napi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer {

// Reads and checks the descriptor array into `out`. The check and the use
// must see the same bytes, so the progress thread gets a validated copy, not
// a pointer into memory JavaScript could still change.
// `where` leads every message (e.g. "writeParts part 2: "), naming the part of a call at fault.
// `local_len` and `remote_len` are the two regions' lengths: every range must lie inside them.
void ReadDescriptors(Napi::Env env, const Napi::Value& v, uint64_t local_len, uint64_t remote_len,
                     std::vector<uint64_t>* out, const std::string& where = "");

}  // namespace kvxfer
