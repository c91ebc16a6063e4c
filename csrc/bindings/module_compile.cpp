#include "bindings/module_register.h"

namespace kiln::bindings {
void register_compile(pybind11::module_& m) {}
}  // namespace kiln::bindings
