#pragma once
#include <string>

namespace kiln::runtime {
/// The LibTorch version kiln._C was built against ("2.13.0"), for cache keys and error messages.
std::string built_torch_version();
}  // namespace kiln::runtime
