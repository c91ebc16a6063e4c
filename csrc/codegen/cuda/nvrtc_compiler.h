#pragma once
// CUDA C -> PTX or cubin through NVRTC, opened with dlopen on first use (DESIGN.md: nothing needs CUDA to
// build or import). Works without a GPU: CI compiles generated kernels to PTX (and even to cubin) here.
//
// libnvrtc is searched in this order: KILN_NVRTC_PATH (the library file or its folder),
// /usr/local/cuda/lib64, the `nvidia-cuda-nvrtc` wheel's lib folder (python package `nvidia`, found with
// importlib: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib, nvidia/cu12/lib), then the plain sonames.
#include <string>
#include <vector>

namespace kiln::codegen::cuda {

struct NvrtcVersion {
  int major = 0;
  int minor = 0;
};

/// Sets how the `nvidia-cuda-nvrtc` wheel's lib folders are found (the Python module: importlib, with the GIL taken
/// inside); without it the wheel is not searched. Call before the first NVRTC use.
void set_nvrtc_wheel_search(std::vector<std::string> (*wheel_dirs)());

/// True when libnvrtc can be opened. Never throws.
bool nvrtc_available();
/// The loaded NVRTC's version (part of every kernel cache key). Throws kiln::Error (KilnError) naming the
/// paths tried and what to install when NVRTC is not found.
NvrtcVersion nvrtc_version();
/// The file libnvrtc was opened from; "" when it is not available.
std::string nvrtc_library_path();
/// The GPU architectures this NVRTC can emit code for, as numbers (75, 80, 86, 89, 90, ...).
std::vector<int> nvrtc_supported_archs();

/// The architecture to compile for a device of compute capability major.minor: "sm_XY" (a cubin) when this
/// NVRTC knows the device, else "compute_XY" of the newest architecture it knows (PTX the driver JITs).
std::string target_arch_for(int major, int minor);

/// A header the source may #include by name (device helpers from csrc/device_lib/cuda).
struct CudaHeader {
  std::string name;
  std::string content;
};

struct NvrtcOptions {
  /// "compute_XY" -> PTX text; "sm_XY" -> cubin (SASS for that GPU). compute_90 targets H100/H200.
  std::string arch = "compute_90";
  bool line_info = false;  ///< -lineinfo: source lines in profiles, at no cost in speed
  std::vector<std::string> extra_flags;
  std::vector<CudaHeader> headers;
};

struct CompiledCuda {
  std::string image;      ///< cubin bytes for an sm_ target, PTX text for a compute_ target
  bool is_cubin = false;
  std::string arch;       ///< the target compiled for
  std::string log;        ///< NVRTC's warnings ("" when none)
  NvrtcVersion version;   ///< of the NVRTC that compiled it
  double compile_ms = 0;  ///< wall time of nvrtcCompileProgram
  bool in_worker = false; ///< compiled by an NVRTC worker process (nvrtc_workers.h)
};

/// Compiles one program (any number of extern "C" __global__ kernels) with -default-device and --std=c++17.
/// A compile error throws kiln::Error (KilnError) whose message holds NVRTC's log and quotes each failing
/// source line with its number; KILN_LOGS=output_code also prints the numbered source.
/// `in_worker`: compile in an NVRTC worker process (nvrtc_workers.h) when one is free, else here; the result and
/// the errors are the same either way.
CompiledCuda compile_cuda(const std::string& source, const std::string& program_name, const NvrtcOptions& options,
                          bool in_worker = false);

}  // namespace kiln::codegen::cuda
