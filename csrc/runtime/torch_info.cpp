#include "runtime/torch_info.h"

#include <torch/version.h>

namespace kiln::runtime {
std::string built_torch_version() { return TORCH_VERSION; }
}  // namespace kiln::runtime
