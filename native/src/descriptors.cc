// Descriptor parsing (descriptors.h): one typed array read once into a checked copy.
#include "descriptors.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "wire.h"

namespace kvxfer {

namespace {

constexpr double kMaxSafe = 9007199254740992.0;  // 2^53

}  // namespace

void ReadDescriptors(Napi::Env env, const Napi::Value& v, uint64_t local_len, uint64_t remote_len,
                     std::vector<uint64_t>* out, const std::string& where) {
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

}  // namespace kvxfer
