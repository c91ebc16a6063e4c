// The device backend table (device_backend.h): one entry per device type kiln generates code for.
#include "codegen/device_backend.h"

#include <chrono>
#include <utility>

#include "codegen/cpp/cpp_backend.h"
#include "codegen/cuda/cuda_backend.h"
#include "common/error.h"

namespace kiln::codegen {

namespace {

struct Registered {
  graph::DeviceType type;
  const DeviceBackend& (*backend)();
};

constexpr Registered kBackends[] = {
    {graph::DeviceType::CPU, cpp::cpp_backend},
    {graph::DeviceType::CUDA, cuda::cuda_backend},
};

}  // namespace

double DeviceBackend::time_ms(const std::function<void()>& work, int, void*, int reps) const {
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) work();
  const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
  return reps > 0 ? elapsed.count() / reps : 0.0;
}

const DeviceBackend& device_backend(graph::DeviceType type) {
  for (const Registered& r : kBackends)
    if (r.type == type) return r.backend();
  KILN_UNSUPPORTED() << "kiln generates code for CPU and CUDA tensors, not " << graph::device_type_name(type);
}

const DeviceBackend& device_backend_named(const std::string& name) {
  for (const Registered& r : kBackends)
    if (name == r.backend().name()) return r.backend();
  KILN_ERROR_IMPL(::kiln::ErrorKind::User, "") << "no device backend named '" << name << "'";
}

}  // namespace kiln::codegen
