#pragma once
// The CUDA driver API, opened with dlopen on first use (DESIGN.md: nothing needs CUDA to build or import).
// kiln declares the few driver types and entry points it calls itself instead of including cuda.h, so this
// file compiles on machines without a toolkit; the declarations follow the driver's stable C ABI.
// Every failing call becomes a kiln::Error that names the call and the driver's error name and text, so
// Python sees an exception, never an abort.
// It sits in codegen/ because loading what NVRTC compiled is the code generator's job (cuda_program_cache.h);
// runtime/ adds only torch's current stream to launch on (runtime/cuda_launch.h). Nothing here includes torch.
#include <cstdint>
#include <string>

namespace kiln::codegen::cuda {

// Opaque driver handles (the same pointers cuda.h's CUcontext/CUmodule/CUfunction/CUstream are).
using CudaResult = int;  // CUresult; 0 is CUDA_SUCCESS
using CudaDevice = int;  // CUdevice
using CudaContext = struct CudaContextOpaque*;
using CudaModule = struct CudaModuleOpaque*;
using CudaFunction = struct CudaFunctionOpaque*;
using CudaStream = void*;  // CUstream == cudaStream_t; nullptr is the legacy default stream
using CudaEvent = struct CudaEventOpaque*;  // CUevent

/// The driver entry points kiln uses, resolved by name from libcuda.
struct DriverApi {
  CudaResult (*cuInit)(unsigned flags);
  CudaResult (*cuDriverGetVersion)(int* version);
  CudaResult (*cuDeviceGetCount)(int* count);
  CudaResult (*cuDeviceGet)(CudaDevice* device, int ordinal);
  CudaResult (*cuDeviceGetAttribute)(int* value, int attribute, CudaDevice device);
  CudaResult (*cuDeviceGetName)(char* name, int length, CudaDevice device);
  CudaResult (*cuDevicePrimaryCtxRetain)(CudaContext* context, CudaDevice device);
  CudaResult (*cuCtxGetCurrent)(CudaContext* context);
  CudaResult (*cuCtxSetCurrent)(CudaContext context);
  CudaResult (*cuCtxGetDevice)(CudaDevice* device);
  CudaResult (*cuModuleLoadData)(CudaModule* module, const void* image);
  CudaResult (*cuModuleUnload)(CudaModule module);
  CudaResult (*cuModuleGetFunction)(CudaFunction* function, CudaModule module, const char* name);
  CudaResult (*cuFuncGetAttribute)(int* value, int attribute, CudaFunction function);
  CudaResult (*cuLaunchKernel)(CudaFunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                               unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                               CudaStream stream, void** kernel_params, void** extra);
  // Autotuning's timings (DeviceBackend::time_ms) and its test for a stream being captured into a CUDA graph.
  CudaResult (*cuEventCreate)(CudaEvent* event, unsigned flags);
  CudaResult (*cuEventRecord)(CudaEvent event, CudaStream stream);
  CudaResult (*cuEventSynchronize)(CudaEvent event);
  CudaResult (*cuEventElapsedTime)(float* milliseconds, CudaEvent start, CudaEvent end);
  CudaResult (*cuEventDestroy)(CudaEvent event);
  CudaResult (*cuStreamIsCapturing)(CudaStream stream, int* status);  // CUstreamCaptureStatus; 0: not capturing
  CudaResult (*cuGetErrorName)(CudaResult error, const char** name);
  CudaResult (*cuGetErrorString)(CudaResult error, const char** text);
};

// The attribute numbers kiln reads (values of cuda.h's CUdevice_attribute / CUfunction_attribute).
constexpr int kDeviceAttributeMultiprocessorCount = 16;
constexpr int kDeviceAttributeComputeCapabilityMajor = 75;
constexpr int kDeviceAttributeComputeCapabilityMinor = 76;
constexpr int kFunctionAttributeMaxThreadsPerBlock = 0;
constexpr int kFunctionAttributeNumRegisters = 4;

/// True when libcuda can be opened and cuInit succeeds (a driver and a device are present). Never throws.
bool driver_available();
/// libcuda's entry points, loaded and cuInit-ed once per process (thread-safe). Throws kiln::Error
/// (KilnError) when no driver is found or cuInit fails, with the paths tried.
const DriverApi& driver();
/// The file libcuda was opened from ("" before the first successful load).
std::string driver_library_path();

/// Throws kiln::Error for a failed driver call: "<what> failed: CUDA_ERROR_<NAME> (<text>)".
void check(CudaResult result, const char* what);
/// The driver's name and text for an error code, e.g. "CUDA_ERROR_INVALID_VALUE (invalid argument)".
std::string describe_error(CudaResult result);

struct ComputeCapability {
  int major = 0;
  int minor = 0;
};
/// The compute capability of device `ordinal` (9.0 on H100/H200).
ComputeCapability compute_capability(int ordinal);
/// The number of streaming multiprocessors of device `ordinal`.
int multiprocessor_count(int ordinal);
/// The product name of device `ordinal` ("NVIDIA H100 80GB HBM3").
std::string device_name(int ordinal);
int device_count();

/// Makes the primary context of device `ordinal` current on the calling thread for the guard's lifetime,
/// unless a context of that device already is (the common case: torch made it current on its threads).
/// A new thread gets the primary context, retained once per device and process. The previous context is
/// restored on destruction, as torch's device guards do.
class DeviceContextGuard {
 public:
  explicit DeviceContextGuard(int ordinal);
  ~DeviceContextGuard();
  DeviceContextGuard(const DeviceContextGuard&) = delete;
  DeviceContextGuard& operator=(const DeviceContextGuard&) = delete;
  CudaContext context() const { return context_; }

 private:
  CudaContext context_ = nullptr;   // current while the guard lives
  CudaContext previous_ = nullptr;  // restored on destruction when it differs
  bool switched_ = false;
};

}  // namespace kiln::codegen::cuda
