// Opens libcuda once per process and wraps the calls kiln needs. The library is looked up where the
// driver installs it (the loader's path, then /usr/local/nvidia/lib64 on the GPU machine); when torch
// already loaded it, dlopen returns that same copy by soname.
#include "codegen/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "common/dynamic_library.h"
#include "common/error.h"
#include "common/log.h"

namespace kiln::codegen::cuda {
namespace {

constexpr const char* kDriverCandidates[] = {
    "libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so",
    "libcuda.so",
};

struct LoadedDriver {
  DriverApi api{};
  bool ok = false;
  std::string path;
  std::string failure;  // why loading failed, with every path tried
};


std::string describe_with(const DriverApi& a, CudaResult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (a.cuGetErrorName) a.cuGetErrorName(result, &name);
  if (a.cuGetErrorString) a.cuGetErrorString(result, &text);
  std::ostringstream out;
  out << (name ? name : "CUDA error") << " " << result;
  if (text) out << " (" << text << ")";
  return out.str();
}

// `name`, else the older `fallback` with the same signature.
template <typename Fn>
void resolve_either(void* handle, const char* name, const char* fallback, Fn*& slot, std::string& missing) {
  slot = reinterpret_cast<Fn*>(dlsym(handle, name));
  if (!slot) resolve_symbol(handle, fallback, slot, missing);
}

LoadedDriver load_driver() {
  LoadedDriver loaded;
  OpenedLibrary opened = open_first_library({std::begin(kDriverCandidates), std::end(kDriverCandidates)});
  void* handle = opened.handle;
  loaded.path = opened.path;
  if (!handle) {
    loaded.failure = "the CUDA driver (libcuda) was not found; tried:" + opened.tried +
                     "\nCUDA kernels need an NVIDIA driver; on a machine without one use CPU tensors.";
    return loaded;
  }
  DriverApi& a = loaded.api;
  std::string missing;
  resolve_symbol(handle, "cuInit", a.cuInit, missing);
  resolve_symbol(handle, "cuDriverGetVersion", a.cuDriverGetVersion, missing);
  resolve_symbol(handle, "cuDeviceGetCount", a.cuDeviceGetCount, missing);
  resolve_symbol(handle, "cuDeviceGet", a.cuDeviceGet, missing);
  resolve_symbol(handle, "cuDeviceGetAttribute", a.cuDeviceGetAttribute, missing);
  resolve_symbol(handle, "cuDeviceGetName", a.cuDeviceGetName, missing);
  resolve_symbol(handle, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain, missing);
  resolve_symbol(handle, "cuCtxGetCurrent", a.cuCtxGetCurrent, missing);
  resolve_symbol(handle, "cuCtxSetCurrent", a.cuCtxSetCurrent, missing);
  resolve_symbol(handle, "cuCtxGetDevice", a.cuCtxGetDevice, missing);
  resolve_symbol(handle, "cuModuleLoadData", a.cuModuleLoadData, missing);
  resolve_symbol(handle, "cuModuleUnload", a.cuModuleUnload, missing);
  resolve_symbol(handle, "cuModuleGetFunction", a.cuModuleGetFunction, missing);
  resolve_symbol(handle, "cuFuncGetAttribute", a.cuFuncGetAttribute, missing);
  resolve_symbol(handle, "cuLaunchKernel", a.cuLaunchKernel, missing);
  // cuda.h maps cuEventDestroy to its _v2 (CUDA 4.0) and cuEventElapsedTime to its _v2 (CUDA 12.8, drivers from 570);
  // an older driver has only the first versions, whose calls are the same.
  resolve_symbol(handle, "cuEventCreate", a.cuEventCreate, missing);
  resolve_symbol(handle, "cuEventRecord", a.cuEventRecord, missing);
  resolve_symbol(handle, "cuEventSynchronize", a.cuEventSynchronize, missing);
  resolve_either(handle, "cuEventElapsedTime_v2", "cuEventElapsedTime", a.cuEventElapsedTime, missing);
  resolve_either(handle, "cuEventDestroy_v2", "cuEventDestroy", a.cuEventDestroy, missing);
  resolve_symbol(handle, "cuStreamIsCapturing", a.cuStreamIsCapturing, missing);
  resolve_symbol(handle, "cuGetErrorName", a.cuGetErrorName, missing);
  resolve_symbol(handle, "cuGetErrorString", a.cuGetErrorString, missing);
  if (!missing.empty()) {
    loaded.failure = "the CUDA driver at " + loaded.path + " lacks " + missing + ": update the NVIDIA driver";
    return loaded;
  }
  // The handle stays open for the life of the process: modules and functions point into it.
  CudaResult init = a.cuInit(0);
  if (init != 0) {
    loaded.failure = "cuInit failed: " + describe_with(a, init) + " (driver " + loaded.path + ")";
    return loaded;
  }
  loaded.ok = true;
  KILN_LOG(perf) << "CUDA driver loaded from " << loaded.path;
  return loaded;
}

const LoadedDriver& loaded_driver() {
  static const LoadedDriver loaded = load_driver();  // thread-safe, once
  return loaded;
}

}  // namespace

bool driver_available() { return loaded_driver().ok; }

const DriverApi& driver() {
  const LoadedDriver& loaded = loaded_driver();
  KILN_CHECK(loaded.ok) << loaded.failure;
  return loaded.api;
}

std::string driver_library_path() { return loaded_driver().ok ? loaded_driver().path : std::string(); }

std::string describe_error(CudaResult result) { return describe_with(loaded_driver().api, result); }

void check(CudaResult result, const char* what) {
  if (result == 0) return;
  // A user-facing error: most failures here are launch configurations or a broken device, not kiln bugs.
  KILN_CHECK(false) << what << " failed: " << describe_error(result);
}

int device_count() {
  int count = 0;
  check(driver().cuDeviceGetCount(&count), "cuDeviceGetCount");
  return count;
}

ComputeCapability compute_capability(int ordinal) {
  const DriverApi& a = driver();
  CudaDevice device = 0;
  check(a.cuDeviceGet(&device, ordinal), "cuDeviceGet");
  ComputeCapability cc;
  check(a.cuDeviceGetAttribute(&cc.major, kDeviceAttributeComputeCapabilityMajor, device), "cuDeviceGetAttribute");
  check(a.cuDeviceGetAttribute(&cc.minor, kDeviceAttributeComputeCapabilityMinor, device), "cuDeviceGetAttribute");
  return cc;
}

std::string device_name(int ordinal) {
  const DriverApi& a = driver();
  CudaDevice device = 0;
  check(a.cuDeviceGet(&device, ordinal), "cuDeviceGet");
  char name[256] = {};
  check(a.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName");
  return name;
}

int multiprocessor_count(int ordinal) {
  const DriverApi& a = driver();
  CudaDevice device = 0;
  check(a.cuDeviceGet(&device, ordinal), "cuDeviceGet");
  int count = 0;
  check(a.cuDeviceGetAttribute(&count, kDeviceAttributeMultiprocessorCount, device), "cuDeviceGetAttribute");
  return count;
}

namespace {

// Primary contexts retained by kiln, one per device, never released: torch keeps them alive anyway,
// and releasing at exit would race the driver's own teardown.
CudaContext retained_primary_context(int ordinal) {
  static std::mutex mutex;
  static std::unordered_map<int, CudaContext>* contexts = new std::unordered_map<int, CudaContext>();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = contexts->find(ordinal);
  if (found != contexts->end()) return found->second;
  const DriverApi& a = driver();
  CudaDevice device = 0;
  check(a.cuDeviceGet(&device, ordinal), "cuDeviceGet");
  CudaContext context = nullptr;
  check(a.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  contexts->emplace(ordinal, context);
  return context;
}

// Which device the thread's current context belongs to, remembered per thread: asking the driver for
// the device of a context costs a call, and the current context rarely changes between launches.
thread_local CudaContext cached_context = nullptr;
thread_local int cached_context_device = -1;

int device_of_current(const DriverApi& a, CudaContext current) {
  if (current == cached_context) return cached_context_device;
  CudaDevice device = -1;
  check(a.cuCtxGetDevice(&device), "cuCtxGetDevice");
  // The ordinal is what cuDeviceGet(ordinal) returns: on every driver CUdevice equals the ordinal.
  cached_context = current;
  cached_context_device = device;
  return device;
}

}  // namespace

DeviceContextGuard::DeviceContextGuard(int ordinal) {
  const DriverApi& a = driver();
  check(a.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
  if (previous_ && device_of_current(a, previous_) == ordinal) {
    context_ = previous_;
    return;
  }
  context_ = retained_primary_context(ordinal);
  check(a.cuCtxSetCurrent(context_), "cuCtxSetCurrent");
  // Keep the primary context on a thread that had none (a worker thread's later calls find it); put
  // back another device's context, as a device guard would.
  switched_ = previous_ != nullptr;
}

DeviceContextGuard::~DeviceContextGuard() {
  if (switched_) loaded_driver().api.cuCtxSetCurrent(previous_);  // no throw from a destructor
}

}  // namespace kiln::codegen::cuda
