#include "mac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/params.h>

#include <string>

namespace kvxfer {

namespace {

constexpr size_t kMacBytes = 32;  // SHA-256

// The HMAC implementation, fetched once per process (on the JavaScript thread, the only caller).
EVP_MAC* HmacAlgorithm() {
  static EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  return mac;
}

const uint8_t* BytesArg(const Napi::CallbackInfo& info, size_t i, const char* what,
                        size_t* length) {
  if (info.Length() <= i || !info[i].IsTypedArray() ||
      info[i].As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array) {
    throw Napi::TypeError::New(info.Env(),
                               std::string("MacKey: ") + what + " must be a Uint8Array");
  }
  auto a = info[i].As<Napi::Uint8Array>();
  *length = a.ByteLength();
  return a.Data();
}

}  // namespace

Napi::Function MacKey::Define(Napi::Env env) {
  return DefineClass(
      env, "MacKey",
      {InstanceMethod<&MacKey::Sign>("sign"), InstanceMethod<&MacKey::Verify>("verify")});
}

MacKey::MacKey(const Napi::CallbackInfo& info) : Napi::ObjectWrap<MacKey>(info) {
  size_t length = 0;
  const uint8_t* key = BytesArg(info, 0, "the key", &length);
  if (length == 0) throw Napi::TypeError::New(info.Env(), "MacKey: the key is empty");
  EVP_MAC* mac = HmacAlgorithm();
  if (mac == nullptr) throw Napi::Error::New(info.Env(), "MacKey: OpenSSL has no HMAC");
  ctx_ = EVP_MAC_CTX_new(mac);
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  if (ctx_ == nullptr || EVP_MAC_init(ctx_, key, length, params) != 1) {
    EVP_MAC_CTX_free(ctx_);
    ctx_ = nullptr;
    throw Napi::Error::New(info.Env(), "MacKey: OpenSSL could not set up HMAC-SHA256");
  }
}

MacKey::~MacKey() { EVP_MAC_CTX_free(ctx_); }

bool MacKey::Compute(const uint8_t* data, size_t length, uint8_t* out) {
  EVP_MAC_CTX* c = EVP_MAC_CTX_dup(ctx_);
  size_t written = 0;
  const bool ok = c != nullptr && EVP_MAC_update(c, data, length) == 1 &&
                  EVP_MAC_final(c, out, &written, kMacBytes) == 1 && written == kMacBytes;
  EVP_MAC_CTX_free(c);
  return ok;
}

Napi::Value MacKey::Sign(const Napi::CallbackInfo& info) {
  size_t length = 0;
  const uint8_t* data = BytesArg(info, 0, "the message", &length);
  Napi::Buffer<uint8_t> out = Napi::Buffer<uint8_t>::New(info.Env(), kMacBytes);
  if (!Compute(data, length, out.Data()))
    throw Napi::Error::New(info.Env(), "MacKey: HMAC-SHA256 failed");
  return out;
}

Napi::Value MacKey::Verify(const Napi::CallbackInfo& info) {
  size_t length = 0, mac_length = 0;
  const uint8_t* data = BytesArg(info, 0, "the message", &length);
  const uint8_t* mac = BytesArg(info, 1, "the MAC", &mac_length);
  if (mac_length != kMacBytes) return Napi::Boolean::New(info.Env(), false);
  uint8_t expected[kMacBytes];
  if (!Compute(data, length, expected))
    throw Napi::Error::New(info.Env(), "MacKey: HMAC-SHA256 failed");
  const bool equal = CRYPTO_memcmp(expected, mac, kMacBytes) == 0;
  OPENSSL_cleanse(expected, sizeof(expected));
  return Napi::Boolean::New(info.Env(), equal);
}

}  // namespace kvxfer
