#pragma once
// Python <-> LibTorch conversions used by the bindings, implemented in backends.cpp so that only one
// runtime translation unit includes torch's Python headers. All need the GIL.
#include <vector>

#include "runtime/compiled_graph.h"

struct _object;
typedef struct _object PyObject;

namespace kiln::runtime {

/// A list/tuple of torch.Tensor -> tensors (a user error names the first non-tensor).
std::vector<at::Tensor> tensors_from_python(PyObject* sequence, const char* what);
/// New reference to the tensor as a torch.Tensor.
PyObject* tensor_to_python(const at::Tensor& tensor);
/// New reference to a Python list of the tensors.
PyObject* tensors_to_python(const std::vector<at::Tensor>& tensors);
/// New reference to {"dtypes": {torch.dtype: code}, "layouts": {...}, "memory_formats": {...},
/// "device_types": {"cpu": 0, ...}}: c10's numbering, which graph/ uses, as the recorder needs it.
PyObject* enum_codes_for_python();

}  // namespace kiln::runtime
