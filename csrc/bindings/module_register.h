#pragma once
// kiln._C is assembled from one registration function per area, each in bindings/module_<area>.cpp.
#include <pybind11/pybind11.h>

namespace kiln::bindings {
void register_graph(pybind11::module_& m);    // module_graph.cpp: Graph, recorder bridge, backends
void register_compile(pybind11::module_& m);  // module_compile.cpp: compile wrapper, stats, reset
void register_compiler(pybind11::module_& m);  // module_compiler.cpp: the kiln backend's stats and summaries
void register_cuda(pybind11::module_& m);     // module_cuda.cpp: kiln._C.cuda (NVRTC, driver API, launches)
void install_python_hooks();                  // module_hooks.cpp: what the Python-free layers ask of the interpreter
}  // namespace kiln::bindings
