// SHA-256 through libcrypto's one-shot EVP_Digest (see sha256.h).
#include "common/sha256.h"

#include "common/dynamic_library.h"

namespace kiln {
namespace {

// OpenSSL's types stay opaque: kiln needs no OpenSSL headers to build.
using EvpSha256 = const void*();
using EvpDigest = int(const void* data, size_t count, unsigned char* md, unsigned int* size, const void* type,
                      void* engine);

struct Crypto {
  EvpSha256* sha256 = nullptr;
  EvpDigest* digest = nullptr;
  std::string unavailable;  // "" once both symbols are found
};

const Crypto& crypto() {
  static const Crypto loaded = [] {
    Crypto c;
    OpenedLibrary lib = open_first_library({"libcrypto.so.3"}, RTLD_NOLOAD);
    if (!lib.handle) lib = open_first_library({"libcrypto.so.3", "libcrypto.so"});
    if (!lib.handle) {
      c.unavailable = "no libcrypto (OpenSSL) could be opened:" + lib.tried;
      return c;
    }
    std::string missing;
    resolve_symbol(lib.handle, "EVP_sha256", c.sha256, missing);
    resolve_symbol(lib.handle, "EVP_Digest", c.digest, missing);
    if (!missing.empty()) c.unavailable = lib.path + " lacks " + missing;
    return c;
  }();
  return loaded;
}

}  // namespace

std::optional<std::string> sha256_hex(std::string_view data) {
  const Crypto& c = crypto();
  if (!c.unavailable.empty()) return std::nullopt;
  unsigned char md[32];
  unsigned int size = 0;
  if (c.digest(data.data(), data.size(), md, &size, c.sha256(), nullptr) != 1 || size != sizeof md) return std::nullopt;
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(2 * sizeof md, '0');
  for (size_t i = 0; i < sizeof md; ++i) {
    hex[2 * i] = kDigits[md[i] >> 4];
    hex[2 * i + 1] = kDigits[md[i] & 15];
  }
  return hex;
}

const std::string& sha256_unavailable() { return crypto().unavailable; }

}  // namespace kiln
