// Shared helpers of the N-API classes: JavaScript errors carrying a stable
// `code`, the wire format of worker addresses and remote keys, and the raw
// bytes of a JavaScript buffer.
#pragma once

#include <napi.h>
#include <ucs/type/status.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer {

// Errors: every error carries a stable string `code`; UCX failures also carry
// the numeric `ucsStatus`. The TypeScript layer turns these into KvxferError.
Napi::Error MakeError(Napi::Env env, const std::string& code, const std::string& message,
                      ucs_status_t status = UCS_OK, bool range = false);
Napi::Error UcsError(Napi::Env env, const std::string& what, ucs_status_t status);

// Wire blobs. A worker address or remote key that crosses the network is
// wrapped with a magic, a length and a checksum, so that garbage is refused
// here instead of being parsed by UCX (which trusts its input).
std::vector<uint8_t> WrapAddress(const std::vector<uint8_t>& raw);
bool UnwrapAddress(const uint8_t* p, size_t n, std::vector<uint8_t>* raw);

struct RemoteBlob {
  uint64_t address = 0;
  uint64_t length = 0;
  std::vector<uint8_t> rkey;
};
std::vector<uint8_t> WrapRemote(uint64_t address, uint64_t length, const void* rkey, size_t size);
bool UnwrapRemote(const uint8_t* p, size_t n, RemoteBlob* out);

// Raw bytes of a Buffer, TypedArray, DataView or ArrayBuffer.
bool BytesOf(const Napi::Value& v, const uint8_t** data, size_t* size);

// A JavaScript array of these strings.
Napi::Array StringArray(Napi::Env env, const std::vector<std::string>& items);

}  // namespace kvxfer
