#include "compile/options.h"

#include <cstdlib>

#include "common/error.h"

namespace kiln::compile {

namespace {
struct ModeName {
  Mode mode;
  const char* name;
};
constexpr ModeName kModeNames[] = {
    {Mode::kDefault, "default"},
    {Mode::kReduceOverhead, "reduce-overhead"},
    {Mode::kMaxAutotune, "max-autotune"},
    {Mode::kMaxAutotuneNoCudagraphs, "max-autotune-no-cudagraphs"},
};
}  // namespace

const char* mode_name(Mode mode) {
  for (const ModeName& m : kModeNames)
    if (m.mode == mode) return m.name;
  return "?";
}

Mode parse_mode(const std::string& name) {
  for (const ModeName& m : kModeNames)
    if (name == m.name) return m.mode;
  KILN_CHECK(false) << "unknown mode '" << name << "': choose default, reduce-overhead, max-autotune or "
                    << "max-autotune-no-cudagraphs";
  return Mode::kDefault;
}

std::string CompileOptions::cache_key() const {
  // Dynamic is left out while every policy specialises sizes: the same graph compiles to the same code. Of the
  // modes, only autotuning changes the code.
  // Kernels with size arguments take them in another signature: never the same entry as literal sizes. Left out when
  // off, so static graphs keep their keys.
  return std::string("autotune=") + (tunes() ? "1" : "0") + (size_arguments ? ", size_arguments=1" : "");
}

std::string CompileOptions::dump_dir() const {
  if (!debug_dir.empty()) return debug_dir;
  const char* env = std::getenv("KILN_DEBUG_DIR");
  return env ? env : "";
}

}  // namespace kiln::compile
