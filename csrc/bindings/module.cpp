// kiln._C: the compiler (trace, guards, graph, runtime) with LibTorch. Import torch first.
#include <pybind11/pybind11.h>

#include "bindings/core_register.h"
#include "bindings/module_register.h"
#include "runtime/torch_info.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "kiln's compiler: frame hook, tracer, guards, graphs and backends";
  m.attr("built_torch_version") = kiln::runtime::built_torch_version();
  kiln::bindings::install_python_hooks();
  kiln::bindings::register_errors(m);
  kiln::bindings::register_graph(m);
  kiln::bindings::register_shape_rules(m);
  kiln::bindings::register_symbolic_graph(m);
  kiln::bindings::register_compile(m);
  kiln::bindings::register_compiler(m);
  kiln::bindings::register_cuda(m);
}
