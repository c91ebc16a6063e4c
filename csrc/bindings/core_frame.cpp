#include "bindings/core_register.h"

namespace kiln::bindings {
void register_frame(pybind11::module_& m) {}
}  // namespace kiln::bindings
