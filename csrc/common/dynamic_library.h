#pragma once
// Opening optional shared libraries at run time (libnvrtc, libcuda, libcrypto): nothing links against them, so
// kiln builds and imports on machines that have none of them.
#include <dlfcn.h>

#include <string>
#include <vector>

namespace kiln {

struct OpenedLibrary {
  void* handle = nullptr;  ///< nullptr when no candidate loaded (kept open for the process otherwise)
  std::string path;        ///< the candidate that loaded
  std::string tried;       ///< one "\n  <candidate>: <dlerror>" line per candidate that failed
};

/// dlopen()s the first candidate that loads (RTLD_NOW | RTLD_LOCAL | `extra_flags`; RTLD_NOLOAD: only one the
/// process has loaded already).
inline OpenedLibrary open_first_library(const std::vector<std::string>& candidates, int extra_flags = 0) {
  OpenedLibrary out;
  for (const std::string& candidate : candidates) {
    out.handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | extra_flags);
    if (out.handle) {
      out.path = candidate;
      return out;
    }
    const char* why = dlerror();
    out.tried += "\n  " + candidate + ": " + (why ? why : "not loadable");
  }
  return out;
}

/// Looks `name` up in `handle` into `slot`; a missing symbol is appended to `missing` ("a, b").
template <typename Fn>
bool resolve_symbol(void* handle, const char* name, Fn*& slot, std::string& missing) {
  slot = reinterpret_cast<Fn*>(dlsym(handle, name));
  if (!slot) missing += std::string(missing.empty() ? "" : ", ") + name;
  return slot != nullptr;
}

}  // namespace kiln
