// torch's current CUDA stream, for launches through codegen/cuda/loaded_program.h.
//
// How torch's current stream is found without linking CUDA: libc10_cuda.so (loaded by `import torch` on a
// CUDA build) exports `c10::cuda::getCurrentCUDAStream(DeviceIndex)` and `CUDAStream::stream() const`.
// kiln resolves both with dlsym once, when the first CUDA launch asks, and calls them through pointers:
// the first returns a CUDAStream by value (a trivially copyable {Device, StreamId}, 16 bytes, returned in
// registers on x86-64 and aarch64), the second takes it as `this`. That is two indirect calls per launch,
// against ~1 us for `torch.cuda.current_stream().cuda_stream` from Python. Should a future torch rename
// them, the C shim torch keeps ABI-stable for compiled artifacts, `aoti_torch_get_current_cuda_stream`
// (libtorch_cuda.so), is the fallback; callers that know their stream can pass it instead.
#include "runtime/cuda_launch.h"

#include <dlfcn.h>

#include <cstdint>

#include "common/error.h"

namespace kiln::runtime::cuda {
namespace {

// The layout of c10::cuda::CUDAStream, which wraps a c10::Stream {Device{type, index}, StreamId}.
struct TorchStreamValue {
  int8_t device_type;
  int8_t device_index;
  int64_t stream_id;
};
static_assert(sizeof(TorchStreamValue) == 16, "c10::Stream is 16 bytes");

using GetCurrentStreamFn = TorchStreamValue (*)(int8_t device_index);
using StreamHandleFn = void* (*)(const TorchStreamValue* self);
using ShimCurrentStreamFn = int32_t (*)(int32_t device_index, void** stream);

// Itanium-mangled names: c10::cuda::getCurrentCUDAStream(signed char), c10::cuda::CUDAStream::stream() const.
constexpr const char* kGetCurrentStreamSymbol = "_ZN3c104cuda20getCurrentCUDAStreamEa";
constexpr const char* kStreamHandleSymbol = "_ZNK3c104cuda10CUDAStream6streamEv";
constexpr const char* kShimCurrentStreamSymbol = "aoti_torch_get_current_cuda_stream";

struct TorchStreamApi {
  GetCurrentStreamFn get_current = nullptr;
  StreamHandleFn handle_of = nullptr;
  ShimCurrentStreamFn shim_current = nullptr;
  std::string failure;
};

// Looks a symbol up in an already-loaded library (never loads one: a CPU-only torch has none to find).
void* symbol_in_loaded(const char* library, const char* symbol) {
  if (void* global = dlsym(RTLD_DEFAULT, symbol)) return global;
  void* handle = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
  if (!handle) return nullptr;
  void* found = dlsym(handle, symbol);
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took; torch keeps the library loaded
  return found;
}

TorchStreamApi resolve_torch_stream_api() {
  TorchStreamApi api;
  api.get_current = reinterpret_cast<GetCurrentStreamFn>(symbol_in_loaded("libc10_cuda.so", kGetCurrentStreamSymbol));
  api.handle_of = reinterpret_cast<StreamHandleFn>(symbol_in_loaded("libc10_cuda.so", kStreamHandleSymbol));
  if (api.get_current && api.handle_of) return api;
  api.get_current = nullptr;
  api.shim_current =
      reinterpret_cast<ShimCurrentStreamFn>(symbol_in_loaded("libtorch_cuda.so", kShimCurrentStreamSymbol));
  if (api.shim_current) return api;
  api.failure =
      "torch's CUDA library (libc10_cuda.so) is not loaded in this process, so torch's current CUDA stream "
      "cannot be read: launch CUDA kernels from a process whose torch is built with CUDA (torch.cuda.is_available()), "
      "or pass the stream explicitly";
  return api;
}

const TorchStreamApi& torch_stream_api() {
  static const TorchStreamApi api = resolve_torch_stream_api();
  return api;
}

}  // namespace

CudaStream torch_current_stream(int ordinal) {
  const TorchStreamApi& api = torch_stream_api();
  KILN_CHECK(api.get_current || api.shim_current) << api.failure;
  KILN_CHECK(ordinal >= 0 && ordinal < 128) << "CUDA device index " << ordinal << " is out of range";
  if (api.get_current) {
    TorchStreamValue stream = api.get_current(static_cast<int8_t>(ordinal));
    return api.handle_of(&stream);
  }
  void* stream = nullptr;
  KILN_CHECK(api.shim_current(ordinal, &stream) == 0)
      << "torch could not report its current CUDA stream on device " << ordinal;
  return stream;
}

}  // namespace kiln::runtime::cuda
