#pragma once
// Each torch-free layer binds itself into kiln._core (and kiln._C re-exports nothing of it).
#include <pybind11/pybind11.h>

namespace kiln::bindings {
void register_errors(pybind11::module_& m);    // core_errors.cpp
void register_bytecode(pybind11::module_& m);  // core_bytecode.cpp
void register_frame(pybind11::module_& m);     // core_frame.cpp
}  // namespace kiln::bindings
