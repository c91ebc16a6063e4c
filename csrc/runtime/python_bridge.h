#pragma once
// Python <-> LibTorch conversions used by the bindings, implemented in python_bridge.cpp so that only one
// runtime translation unit includes torch's Python headers. All need the GIL.
#include <vector>

#include "runtime/compiled_graph.h"

struct _object;
typedef struct _object PyObject;

namespace c10 {
struct IValue;
struct Type;
}  // namespace c10

namespace kiln::runtime {

/// A list/tuple of torch.Tensor -> tensors (a user error names the first non-tensor).
std::vector<at::Tensor> tensors_from_python(PyObject* sequence, const char* what);
/// New reference to the tensor as a torch.Tensor.
PyObject* tensor_to_python(const at::Tensor& tensor);
/// New reference to a Python list of the tensors.
PyObject* tensors_to_python(const std::vector<at::Tensor>& tensors);
/// New reference to an op argument as Python code takes it (a torch.dtype where `type`, the schema's real type, is
/// a ScalarType), or nullptr (no error set) for kinds this does not convert (layouts, memory formats, devices).
PyObject* argument_to_python(const c10::IValue& value, const c10::Type& type);
/// A torch.Tensor (into `out`) or None (`out` undefined): true; anything else: false.
bool tensor_or_none_from_python(PyObject* item, at::Tensor& out);
/// New reference to {"dtypes": {torch.dtype: code}, "layouts": {...}, "memory_formats": {...},
/// "device_types": {"cpu": 0, ...}}: c10's numbering, which graph/ uses, as the recorder needs it.
PyObject* enum_codes_for_python();

}  // namespace kiln::runtime
