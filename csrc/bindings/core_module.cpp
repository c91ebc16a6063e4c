// kiln._core: the torch-free layers (bytecode/, frame/), importable on any supported Python.
#include <pybind11/pybind11.h>

#include "bindings/core_register.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "kiln's torch-free core: bytecode decoding/assembly and the PEP 523 frame hook";
  kiln::bindings::register_errors(m);
  kiln::bindings::register_bytecode(m);
  kiln::bindings::register_frame(m);
}
