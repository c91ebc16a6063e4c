#pragma once
// SHA-256, from OpenSSL's libcrypto opened at run time (dynamic_library.h), as kiln opens NVRTC and libcuda: kiln
// links no crypto library and keeps no hash function of its own. The disk cache names its entries and checks their
// contents with it (cache/kernel_cache.h), so that two different inputs never share an entry.
//
// libcrypto.so.3 is tried first among the libraries the process has loaded already (CPython's _hashlib links it),
// then opened by name, then libcrypto.so. Thread-safe.
#include <optional>
#include <string>
#include <string_view>

namespace kiln {

/// SHA-256 of `data` as 64 lowercase hex digits; nullopt when no libcrypto could be opened (sha256_unavailable()
/// says why).
std::optional<std::string> sha256_hex(std::string_view data);

/// "" when sha256_hex works; else which libraries were tried and what the loader said.
const std::string& sha256_unavailable();

}  // namespace kiln
