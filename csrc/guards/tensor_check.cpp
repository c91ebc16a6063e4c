// Tensor guards and global state: the only guards/ file that includes LibTorch headers.
#include <ATen/autocast_mode.h>
#include <ATen/core/TensorBase.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <sstream>

#include "guards/guard_tree.h"

namespace kiln::guards {

namespace {
std::string list_str(const std::vector<long long>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

template <typename A>
bool same_list(const std::vector<long long>& expected, A actual) {
  if (expected.size() != actual.size()) return false;
  for (size_t i = 0; i < expected.size(); ++i)
    if (expected[i] != actual[i]) return false;
  return true;
}

// Sizes and strides of a tensor with dynamic dims (TensorSpec::dynamic).
bool dynamic_tensor_matches(const at::TensorBase& t, const TensorSpec& spec, std::string* why) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  if (sizes.size() != spec.sizes.size()) {
    if (why) *why = "rank: expected " + std::to_string(spec.sizes.size()) + " dims, got " + std::to_string(sizes.size());
    return false;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    const bool ok = spec.dynamic[d] ? sizes[d] >= 2 : sizes[d] == spec.sizes[d];
    if (!ok) {
      if (why)
        *why = "size of dim " + std::to_string(d) + ": expected " +
               (spec.dynamic[d] ? "2 or more (a dynamic dim; sizes 0 and 1 are specialised)"
                                : std::to_string(spec.sizes[d])) +
               ", got " + std::to_string(sizes[d]);
      return false;
    }
  }
  if (spec.dense_order.empty()) {
    if (!same_list(spec.strides, strides)) {
      if (why) *why = "stride: expected " + list_str(spec.strides) + " (a layout that is not dense), got " +
                      list_str(std::vector<long long>(strides.begin(), strides.end()));
      return false;
    }
    return true;
  }
  int64_t running = 1;
  for (int d : spec.dense_order) {
    if (strides[d] != running) {
      if (why) *why = "stride: expected a dense layout as traced (" + list_str(spec.strides) + " at the traced sizes), got " +
                      list_str(std::vector<long long>(strides.begin(), strides.end()));
      return false;
    }
    running *= std::max<int64_t>(sizes[d], 1);
  }
  return true;
}
}  // namespace

int64_t tensor_size(PyObject* value, int dim) { return THPVariable_Unpack(value).sizes()[dim]; }

TensorSpec tensor_spec_of(PyObject* value) {
  const at::TensorBase& t = THPVariable_Unpack(value);
  TensorSpec spec;
  spec.type = Py_TYPE(value);
  spec.dtype = static_cast<int>(t.scalar_type());
  spec.device_type = static_cast<int>(t.device().type());
  spec.device_index = t.device().index();
  spec.sizes.assign(t.sizes().begin(), t.sizes().end());
  spec.strides.assign(t.strides().begin(), t.strides().end());
  spec.requires_grad = t.requires_grad();
  return spec;
}

std::string describe_tensor_spec(const TensorSpec& spec) {
  std::ostringstream os;
  std::string sizes = list_str(spec.sizes);
  if (!spec.dynamic.empty()) {
    sizes = "[";
    for (size_t d = 0; d < spec.sizes.size(); ++d)
      sizes += (d ? ", " : "") + (spec.dynamic[d] ? std::string("dynamic (traced ") + std::to_string(spec.sizes[d]) + ")"
                                                 : std::to_string(spec.sizes[d]));
    sizes += "]";
  }
  os << c10::toString(static_cast<c10::ScalarType>(spec.dtype)) << sizes << " strides "
     << list_str(spec.strides) << " on " << c10::Device(static_cast<c10::DeviceType>(spec.device_type),
                                                        static_cast<c10::DeviceIndex>(spec.device_index))
     << (spec.requires_grad ? " requires_grad" : "");
  return os.str();
}

bool tensor_matches(PyObject* value, const TensorSpec& spec, std::string* why) {
  if (Py_TYPE(value) != spec.type) {
    if (why) *why = std::string("expected type ") + spec.type->tp_name + ", got " + Py_TYPE(value)->tp_name;
    return false;
  }
  const at::TensorBase& t = THPVariable_Unpack(value);
  auto fail = [&](const char* what, const std::string& expected, const std::string& got) {
    if (why) *why = std::string(what) + ": expected " + expected + ", got " + got;
    return false;
  };
  if (static_cast<int>(t.scalar_type()) != spec.dtype)
    return fail("dtype", c10::toString(static_cast<c10::ScalarType>(spec.dtype)), c10::toString(t.scalar_type()));
  c10::Device d = t.device();
  if (static_cast<int>(d.type()) != spec.device_type || d.index() != spec.device_index) {
    std::ostringstream got;
    got << d;
    return fail("device", describe_tensor_spec(spec), got.str());
  }
  if (!spec.dynamic.empty()) return dynamic_tensor_matches(t, spec, why) &&
                                     (t.requires_grad() == spec.requires_grad ||
                                      fail("requires_grad", spec.requires_grad ? "True" : "False",
                                           t.requires_grad() ? "True" : "False"));
  if (!same_list(spec.sizes, t.sizes())) {
    std::vector<long long> got(t.sizes().begin(), t.sizes().end());
    return fail("size", list_str(spec.sizes), list_str(got));
  }
  if (!same_list(spec.strides, t.strides())) {
    std::vector<long long> got(t.strides().begin(), t.strides().end());
    return fail("stride", list_str(spec.strides), list_str(got));
  }
  if (t.requires_grad() != spec.requires_grad)
    return fail("requires_grad", spec.requires_grad ? "True" : "False", t.requires_grad() ? "True" : "False");
  return true;
}

GlobalState GlobalState::current() {
  GlobalState s;
  s.grad_enabled = c10::GradMode::is_enabled();
  s.inference_mode = c10::InferenceMode::is_enabled();
  s.default_dtype = static_cast<int>(c10::typeMetaToScalarType(c10::get_default_dtype()));
  s.autocast = (at::autocast::is_autocast_enabled(c10::DeviceType::CPU) ? 1 : 0) |
               (at::autocast::is_autocast_enabled(c10::DeviceType::CUDA) ? 2 : 0);
  if (s.autocast & 1) s.autocast_dtype_cpu = static_cast<int>(at::autocast::get_autocast_dtype(c10::DeviceType::CPU));
  if (s.autocast & 2) s.autocast_dtype_cuda = static_cast<int>(at::autocast::get_autocast_dtype(c10::DeviceType::CUDA));
  s.functorch = !at::functorch::getDynamicLayerStack().empty();
  return s;
}

std::string GlobalState::describe() const {
  return std::string("grad_mode ") + (grad_enabled ? "enabled" : "disabled") + ", inference_mode " +
         (inference_mode ? "on" : "off") + ", default dtype " +
         c10::toString(static_cast<c10::ScalarType>(default_dtype)) +
         (autocast & 1 ? std::string(", autocast cpu ") + c10::toString(static_cast<c10::ScalarType>(autocast_dtype_cpu)) : "") +
         (autocast & 2 ? std::string(", autocast cuda ") + c10::toString(static_cast<c10::ScalarType>(autocast_dtype_cuda)) : "") +
         (functorch ? ", inside a torch.func transform" : "");
}

}  // namespace kiln::guards
