// HMAC-SHA256 under one key, computed by the OpenSSL that Node itself carries (the addon
// resolves libcrypto's symbols against the node binary; its headers come with Node's: see
// KVXFER_NODE_INCLUDE in CMakeLists.txt). The key
// is set up once (EVP_MAC_init); each message then costs a copy of that context, one update and
// one final. Peer notifications are sealed and verified with it (src/peer/messages.ts):
// node:crypto's createHmac sets the key up again for every message, which measured 2-4x the
// cost of the whole seal on a sidecar that is idle between transfers.
#pragma once

#include <napi.h>
#include <openssl/evp.h>

namespace kvxfer {

class MacKey : public Napi::ObjectWrap<MacKey> {
 public:
  static Napi::Function Define(Napi::Env env);
  explicit MacKey(const Napi::CallbackInfo& info);
  ~MacKey() override;
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;

 private:
  // sign(message: Uint8Array): Buffer, the 32-byte HMAC-SHA256 of message.
  Napi::Value Sign(const Napi::CallbackInfo& info);
  // verify(message: Uint8Array, mac: Uint8Array): boolean, in constant time over the MAC.
  Napi::Value Verify(const Napi::CallbackInfo& info);
  bool Compute(const uint8_t* data, size_t length, uint8_t* out);

  EVP_MAC_CTX* ctx_ = nullptr;
};

}  // namespace kvxfer
