#pragma once
// kiln._C is assembled from one registration function per area, each in bindings/module_<area>.cpp.
#include <pybind11/pybind11.h>

#include <string>

#include "compile/options.h"

namespace kiln::bindings {
void register_graph(pybind11::module_& m);    // module_graph.cpp: Graph, recorder bridge, backends
void register_shape_rules(pybind11::module_& m);  // module_shape_rules.cpp: the symbolic shape rules' test hook
void register_symbolic_graph(pybind11::module_& m);  // module_symbolic_graph.cpp: symbolic sizes of graphs (tests)
void register_compile(pybind11::module_& m);  // module_compile.cpp: compile wrapper, stats, reset
void register_compiler(pybind11::module_& m);  // module_compiler.cpp: the kiln backend's stats and summaries
void register_cuda(pybind11::module_& m);     // module_cuda.cpp: kiln._C.cuda (NVRTC, driver API, launches)

/// kiln.compile's (and torch.compile's) mode, dynamic and options, validated by kiln/api.py, as the pipeline takes
/// them (module_compile.cpp).
compile::CompileOptions compile_options_from_python(const std::string& mode, pybind11::object dynamic,
                                                    pybind11::dict options);
void install_python_hooks();                  // module_hooks.cpp: what the Python-free layers ask of the interpreter
void install_cuda_graph_api();                // module_cuda_graphs.cpp: CUDA graph recording through torch
}  // namespace kiln::bindings
