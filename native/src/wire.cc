#include "wire.h"

#include <cstring>

#include "ucx_status.h"

namespace kvxfer {

// ---------------------------------------------------------------------------
// Errors: every error carries a stable string `code`; UCX failures also carry
// the numeric `ucsStatus`. The TypeScript layer turns these into KvxferError.

Napi::Error MakeError(Napi::Env env, const std::string& code, const std::string& message,
                      ucs_status_t status, bool range) {
  Napi::Error err = range ? Napi::RangeError::New(env, message) : Napi::Error::New(env, message);
  err.Set("code", Napi::String::New(env, code));
  if (status != UCS_OK) err.Set("ucsStatus", Napi::Number::New(env, static_cast<int>(status)));
  return err;
}

Napi::Error UcsError(Napi::Env env, const std::string& what, ucs_status_t status) {
  return MakeError(env, UcsStatusName(status),
                   what + ": " + UcsStatusName(status) + " (" + ucs_status_string(status) + ")",
                   status);
}

// ---------------------------------------------------------------------------
// Wire blobs. A worker address or remote key that crosses the network is
// wrapped with a magic, a length and a checksum, so that garbage is refused
// here instead of being parsed by UCX (which trusts its input).

namespace {

constexpr uint32_t kAddressMagic = 0x4158564b;  // "KVXA"
constexpr uint32_t kRemoteMagic = 0x5258564b;   // "KVXR"
constexpr size_t kAddressHeader = 16;           // magic, length, checksum(8)
constexpr size_t kRemoteHeader = 40;            // magic, length, address, size, checksum(8)
constexpr size_t kMaxBlob = 1 << 20;

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

template <typename T>
void Put(std::vector<uint8_t>* out, size_t at, T v) {
  std::memcpy(out->data() + at, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p, size_t at) {
  T v;
  std::memcpy(&v, p + at, sizeof(T));
  return v;
}

}  // namespace

std::vector<uint8_t> WrapAddress(const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> out(kAddressHeader + raw.size());
  Put<uint32_t>(&out, 0, kAddressMagic);
  Put<uint32_t>(&out, 4, static_cast<uint32_t>(raw.size()));
  Put<uint64_t>(&out, 8, Fnv1a(raw.data(), raw.size()));
  std::memcpy(out.data() + kAddressHeader, raw.data(), raw.size());
  return out;
}

bool UnwrapAddress(const uint8_t* p, size_t n, std::vector<uint8_t>* raw) {
  if (n < kAddressHeader || n > kMaxBlob || Get<uint32_t>(p, 0) != kAddressMagic) return false;
  uint32_t len = Get<uint32_t>(p, 4);
  if (len != n - kAddressHeader) return false;
  if (Get<uint64_t>(p, 8) != Fnv1a(p + kAddressHeader, len)) return false;
  raw->assign(p + kAddressHeader, p + n);
  return true;
}

std::vector<uint8_t> WrapRemote(uint64_t address, uint64_t length, const void* rkey, size_t size) {
  std::vector<uint8_t> out(kRemoteHeader + size);
  Put<uint32_t>(&out, 0, kRemoteMagic);
  Put<uint32_t>(&out, 4, static_cast<uint32_t>(size));
  Put<uint64_t>(&out, 8, address);
  Put<uint64_t>(&out, 16, length);
  std::memcpy(out.data() + kRemoteHeader, rkey, size);
  // The checksum covers address, size and key.
  Put<uint64_t>(&out, 32, 0);
  uint64_t h = Fnv1a(out.data(), out.size());
  Put<uint64_t>(&out, 32, h);
  return out;
}

bool UnwrapRemote(const uint8_t* p, size_t n, RemoteBlob* out) {
  if (n < kRemoteHeader || n > kMaxBlob || Get<uint32_t>(p, 0) != kRemoteMagic) return false;
  uint32_t len = Get<uint32_t>(p, 4);
  if (len != n - kRemoteHeader) return false;
  std::vector<uint8_t> copy(p, p + n);
  uint64_t want = Get<uint64_t>(p, 32);
  Put<uint64_t>(&copy, 32, 0);
  if (Fnv1a(copy.data(), copy.size()) != want) return false;
  out->address = Get<uint64_t>(p, 8);
  out->length = Get<uint64_t>(p, 16);
  out->rkey.assign(p + kRemoteHeader, p + n);
  // Zero padding: a key from a newer UCX must not make the unpacker read past our copy.
  out->rkey.resize(out->rkey.size() + 64, 0);
  return true;
}

// Raw bytes of a Buffer, TypedArray, DataView or ArrayBuffer.
bool BytesOf(const Napi::Value& v, const uint8_t** data, size_t* size) {
  if (v.IsArrayBuffer()) {
    auto ab = v.As<Napi::ArrayBuffer>();
    *data = static_cast<const uint8_t*>(ab.Data());
    *size = ab.ByteLength();
    return true;
  }
  if (v.IsTypedArray()) {
    auto ta = v.As<Napi::TypedArray>();
    *data = static_cast<const uint8_t*>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
    *size = ta.ByteLength();
    return true;
  }
  if (v.IsDataView()) {
    auto dv = v.As<Napi::DataView>();
    *data = static_cast<const uint8_t*>(dv.ArrayBuffer().Data()) + dv.ByteOffset();
    *size = dv.ByteLength();
    return true;
  }
  return false;
}

Napi::Array StringArray(Napi::Env env, const std::vector<std::string>& items) {
  Napi::Array a = Napi::Array::New(env, items.size());
  for (uint32_t i = 0; i < items.size(); ++i) a.Set(i, Napi::String::New(env, items[i]));
  return a;
}

}  // namespace kvxfer
