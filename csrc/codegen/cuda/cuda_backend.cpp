#include "codegen/cuda/cuda_backend.h"

#include <functional>
#include <vector>

#include "codegen/cuda/cuda_device_lib.h"
#include "codegen/cuda/cuda_program_cache.h"
#include "codegen/cuda/cuda_driver.h"
#include "codegen/cuda/emit_cuda.h"
#include "codegen/cuda/loaded_program.h"
#include "codegen/cuda/nvrtc_compiler.h"
#include "common/error.h"
#include "fusion/launch_groups.h"

namespace kiln::codegen::cuda {

namespace {

// Parameters of one launch group: 8 bytes each, well inside the 4 KiB every CUDA architecture accepts.
constexpr size_t kMaxGroupBuffers = 256;
constexpr CudaResult kErrorStreamCaptureImplicit = 906;  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT

// A pair of timing events (CU_EVENT_DEFAULT: they record times), destroyed with the pair. Made in the current context.
struct TimingEvents {
  CudaEvent start = nullptr, end = nullptr;
  TimingEvents() {
    check(driver().cuEventCreate(&start, 0), "cuEventCreate");
    const CudaResult made = driver().cuEventCreate(&end, 0);
    if (made != 0) driver().cuEventDestroy(start);  // a constructor that throws runs no destructor
    check(made, "cuEventCreate");
  }
  ~TimingEvents() {
    if (start) driver().cuEventDestroy(start);
    if (end) driver().cuEventDestroy(end);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
};

class CudaKernel final : public LoadedKernel {
 public:
  CudaKernel(int device, CudaFunction fn, const cache::KernelEntry& entry)
      : device_(device), fn_(fn), name_(entry.name), sizes_(entry.sizes) {
    config_.grid.x = entry.grid;
    config_.block.x = entry.block_x;
    config_.block.y = entry.block_y;
  }
  bool run(void* const* buffers, size_t count, void* stream) const override {
    if (config_.grid.x == 0) return true;  // an empty domain: nothing to launch
    // cuLaunchKernel takes a pointer to each argument's value; on the stack for all but launch groups.
    // After the buffers, the size slots (a struct of int64 values, by value) where the kernel has any.
    const size_t total = count + (sizes_.empty() ? 0 : 1);
    void* on_stack[64];
    std::vector<void*> on_heap;
    void** arguments = on_stack;
    if (total > 64) {
      on_heap.resize(total);
      arguments = on_heap.data();
    }
    for (size_t b = 0; b < count; ++b) arguments[b] = const_cast<void**>(&buffers[b]);
    if (!sizes_.empty()) arguments[count] = const_cast<int64_t*>(sizes_.data());
    launch_kernel(device_, fn_, name_, config_, static_cast<CudaStream>(stream), arguments);
    return true;
  }

 private:
  int device_;
  CudaFunction fn_;
  std::string name_;
  std::vector<int64_t> sizes_;  // the kernel's size arguments (cache::KernelEntry::sizes)
  LaunchConfig config_;
};

class CudaCode final : public LoadedCode {
 public:
  CudaCode(int device, std::vector<CudaProgram> programs) : device_(device), programs_(std::move(programs)) {}
  std::unique_ptr<LoadedKernel> kernel(const cache::KernelEntry& entry, bool) const override {
    KILN_ASSERT(entry.part >= 0 && static_cast<size_t>(entry.part) < programs_.size()) << "kernel part " << entry.part;
    // may be a twin's (emit_cuda_source), in the part that defines it
    return std::make_unique<CudaKernel>(device_, programs_[entry.part].loaded->function(entry.name), entry);
  }

 private:
  int device_;
  std::vector<CudaProgram> programs_;
};

class CudaBackend final : public DeviceBackend {
 public:
  const char* name() const override { return "cuda"; }

  cache::DeviceCode emit(fusion::Schedule& schedule, const graph::Graph& g, bool keep_peak, bool size_arguments,
                         bool tune) const override {
    // With size arguments, no launch group: its members' block ranges are per binding, and the group kernel would
    // carry every member's sizes.
    const std::vector<int32_t> group =
        size_arguments ? std::vector<int32_t>{} : fusion::hoist_input_kernels(schedule, g, kMaxGroupBuffers, keep_peak);
    CudaSource source = emit_cuda_source(schedule, g, group, size_arguments, tune);
    cache::DeviceCode code;
    code.backend = name();
    code.size_arguments = size_arguments;
    code.parts = std::move(source.parts);
    code.kernels = std::move(source.kernels);
    code.group = std::move(source.group);
    code.group_members = std::move(source.group_members);
    return code;
  }

  void prepare_load() const override {
    nvrtc_version();  // opens NVRTC with the GIL held: its search may ask importlib
    cuda_device_headers();
  }

  std::shared_ptr<const LoadedCode> load(const cache::DeviceCode& code, int index, const std::string&) const override {
    return std::make_shared<CudaCode>(index, cuda_programs_for_device(index, code.parts, "kiln_graph"));
  }

  int multiprocessors(int index) const override { return multiprocessor_count(index); }
  std::string device_name(int index) const override { return cuda::device_name(index); }

  double time_ms(const std::function<void()>& work, int index, void* stream, int reps) const override {
    const DriverApi& a = driver();
    DeviceContextGuard context(index);
    TimingEvents events;
    check(a.cuEventRecord(events.start, stream), "cuEventRecord");
    for (int r = 0; r < reps; ++r) work();
    check(a.cuEventRecord(events.end, stream), "cuEventRecord");
    check(a.cuEventSynchronize(events.end), "cuEventSynchronize");
    float ms = 0;
    check(a.cuEventElapsedTime(&ms, events.start, events.end), "cuEventElapsedTime");
    return reps > 0 ? ms / reps : 0.0;
  }

  bool capturing(void* stream) const override {
    int status = 0;
    const CudaResult result = driver().cuStreamIsCapturing(stream, &status);
    // The legacy default stream cannot be asked while another stream captures in global mode: a capture all the same.
    if (result == kErrorStreamCaptureImplicit) return true;
    check(result, "cuStreamIsCapturing");
    return status != 0;  // CU_STREAM_CAPTURE_STATUS_NONE is 0 (active or invalidated otherwise)
  }
};

}  // namespace

const DeviceBackend& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

}  // namespace kiln::codegen::cuda
