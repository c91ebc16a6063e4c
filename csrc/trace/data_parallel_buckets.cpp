// data_parallel_buckets (see the header): the question put to kiln._tracing, which knows torch.distributed's classes.
#include "trace/data_parallel_buckets.h"

namespace kiln::trace {

namespace {

// An int from a Python int, or -1 (with the error cleared).
int64_t as_int(PyObject* value) {
  const long long v = value && PyLong_Check(value) ? PyLong_AsLongLong(value) : -1;
  if (PyErr_Occurred()) PyErr_Clear();
  return v;
}

}  // namespace

std::shared_ptr<const passes::ParameterBuckets> data_parallel_buckets(PyObject* example_inputs) {
  static PyObject* fn = [] {
    PyObject* m = PyImport_ImportModule("kiln._tracing");
    PyObject* f = m ? PyObject_GetAttrString(m, "data_parallel_buckets") : nullptr;
    Py_XDECREF(m);
    return f;
  }();
  if (!fn || !example_inputs) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* answer = PyObject_CallOneArg(fn, example_inputs);
  std::shared_ptr<passes::ParameterBuckets> buckets;
  // (indices, bucket_bytes, first_bucket_bytes) or None.
  if (answer && PyTuple_Check(answer) && PyTuple_GET_SIZE(answer) == 3 && PyList_Check(PyTuple_GET_ITEM(answer, 0))) {
    buckets = std::make_shared<passes::ParameterBuckets>();
    PyObject* indices = PyTuple_GET_ITEM(answer, 0);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(indices); ++i)
      buckets->parameter_inputs.push_back(static_cast<int32_t>(as_int(PyList_GET_ITEM(indices, i))));
    buckets->bucket_bytes = as_int(PyTuple_GET_ITEM(answer, 1));
    buckets->first_bucket_bytes = as_int(PyTuple_GET_ITEM(answer, 2));
    bool valid = buckets->bucket_bytes > 0;
    for (int32_t index : buckets->parameter_inputs)
      valid = valid && index >= 0 && index < PyList_GET_SIZE(example_inputs);
    if (!valid) buckets = nullptr;
  }
  Py_XDECREF(answer);
  PyErr_Clear();
  return buckets;
}

}  // namespace kiln::trace
