// kiln._C.cuda: the CUDA groundwork (NVRTC compilation, driver-API loading and launching) exposed for tests
// and benchmarks. The CUDA code generator calls the same C++ functions directly.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <climits>

#include "bindings/module_register.h"
#include "codegen/cuda/cuda_device_lib.h"
#include "codegen/cuda/cuda_driver.h"
#include "codegen/cuda/cuda_program_cache.h"
#include "codegen/cuda/loaded_program.h"
#include "codegen/cuda/nvrtc_compiler.h"
#include "codegen/cuda/nvrtc_workers.h"
#include "common/error.h"
#include "runtime/cuda_launch.h"

namespace py = pybind11;

namespace kiln::bindings {
namespace {

namespace cg = kiln::codegen::cuda;
namespace rt = kiln::runtime::cuda;

cg::CompiledCuda compile_for_python(const std::string& source, const std::string& name, const std::string& arch,
                                    bool line_info) {
  cg::nvrtc_version();  // opens NVRTC with the GIL held: its search asks importlib for the wheel's folder
  cg::NvrtcOptions options;
  options.arch = arch;
  options.line_info = line_info;
  options.headers = cg::cuda_device_headers();
  py::gil_scoped_release no_gil;  // NVRTC takes ~100 ms; other Python threads run meanwhile
  return cg::compile_cuda(source, name, options);
}

// One pointer argument per tensor, then the element count: `kernel(T* t0, ..., long long n)`. The kernel
// decides how much of each tensor it touches (a reduction's output holds one element), so sizes are not checked.
void launch_pointwise(const std::string& source, const std::string& kernel_name, const py::list& tensors, long long n,
                      unsigned block, long long elements_per_thread, py::object stream) {
  KILN_CHECK(tensors.size() > 0) << "launch_pointwise needs at least one CUDA tensor";
  KILN_CHECK(block > 0) << "block must be positive, got " << block;
  KILN_CHECK(elements_per_thread > 0) << "elements_per_thread must be positive, got " << elements_per_thread;
  KILN_CHECK(n >= 0) << "n must not be negative, got " << n;
  std::vector<void*> pointers;
  int device = -1;
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* object = tensors[i].ptr();
    KILN_CHECK(THPVariable_Check(object)) << "tensors[" << i << "] is a " << Py_TYPE(object)->tp_name
                                          << ", not a torch.Tensor";
    const at::Tensor& tensor = THPVariable_Unpack(object);
    KILN_CHECK(tensor.is_cuda()) << "tensors[" << i << "] is on " << tensor.device() << ": kernels need CUDA tensors";
    KILN_CHECK(tensor.is_contiguous()) << "tensors[" << i << "] is not contiguous: the kernel indexes it flat";
    int index = tensor.device().index();
    KILN_CHECK(device < 0 || index == device) << "tensors[" << i << "] is on cuda:" << index << ", the first on cuda:"
                                              << device << ": one launch runs on one device";
    device = index;
    pointers.push_back(tensor.data_ptr());
  }
  cg::nvrtc_version();  // as in compile_for_python: the library search may need the GIL
  cg::CudaStream launch_stream =
      stream.is_none() ? rt::torch_current_stream(device) : reinterpret_cast<cg::CudaStream>(stream.cast<uintptr_t>());
  if (n == 0) return;
  long long per_block = static_cast<long long>(block) * elements_per_thread;
  long long blocks = std::min<long long>((n + per_block - 1) / per_block, INT_MAX);
  py::gil_scoped_release no_gil;
  cg::CudaProgram program = cg::cuda_program_for_device(device, source, "kiln_launch_pointwise.cu");
  cg::CudaFunction function = program.loaded->function(kernel_name);
  std::vector<void*> args;
  for (void*& pointer : pointers) args.push_back(&pointer);
  args.push_back(&n);
  cg::LaunchConfig config;
  config.grid.x = static_cast<unsigned>(blocks);
  config.block.x = block;
  cg::launch_kernel(device, function, kernel_name, config, launch_stream, args.data());
}

}  // namespace

void register_cuda(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "cuda", "CUDA groundwork: NVRTC (opened on first use) and the driver API; nothing here needs a GPU to import");
  m.def("nvrtc_available", &cg::nvrtc_available, "True when libnvrtc can be opened (never raises)");
  m.def(
      "nvrtc_version",
      [] {
        cg::NvrtcVersion v = cg::nvrtc_version();
        return py::make_tuple(v.major, v.minor);
      },
      "(major, minor) of the NVRTC kiln opened; raises KilnError naming the paths tried when there is none");
  m.def("nvrtc_library", &cg::nvrtc_library_path, "the libnvrtc file in use ('' when none)");
  m.def("nvrtc_supported_archs", &cg::nvrtc_supported_archs, "GPU architectures NVRTC can target, e.g. [75, ..., 90]");
  m.def("device_headers",
        [] {
          std::vector<std::string> names;
          for (const auto& header : cg::cuda_device_headers()) names.push_back(header.name);
          return names;
        },
        "names of the device helper headers a CUDA source may #include");
  m.def("device_lib_origin", &cg::cuda_device_lib_origin, "where the device helpers were read from");
  m.def(
      "compile_ptx",
      [](const std::string& source, const std::string& name, const std::string& arch, bool line_info) {
        KILN_CHECK(arch.rfind("compute_", 0) == 0) << "compile_ptx takes a virtual architecture like compute_90, not '"
                                                   << arch << "'";
        return compile_for_python(source, name, arch, line_info).image;
      },
      py::arg("source"), py::arg("name"), py::arg("arch") = "compute_90", py::arg("line_info") = false,
      "compile a CUDA C program (extern \"C\" __global__ kernels) to PTX text; errors raise KilnError quoting the "
      "failing line");
  m.def(
      "compile_parts",
      [](const std::vector<std::string>& sources, const std::string& name, const std::string& arch) {
        cg::NvrtcOptions options;
        options.arch = arch;
        options.headers = cg::cuda_device_headers();
        std::vector<cg::CompiledCuda> compiled;
        {
          py::gil_scoped_release no_gil;
          compiled = cg::compile_cuda_parts(sources, name, options);
        }
        py::list out;
        for (const auto& c : compiled)
          out.append(py::dict(py::arg("image") = py::bytes(c.image), py::arg("in_worker") = c.in_worker,
                              py::arg("compile_ms") = c.compile_ms));
        return out;
      },
      py::arg("sources"), py::arg("name"), py::arg("arch") = "compute_90",
      "compile the parts of one program side by side as compiled graphs do (NVRTC worker processes when there is "
      "more than one part); per part a dict of image, in_worker and compile_ms");
  m.def("nvrtc_worker_stats", [] {
    cg::NvrtcWorkerStats s = cg::nvrtc_worker_stats();
    return py::dict(py::arg("started") = s.started, py::arg("answered") = s.answered, py::arg("failed") = s.failed,
                    py::arg("executable") = s.executable, py::arg("unavailable") = s.unavailable,
                    py::arg("idle_pids") = s.idle_pids);
  }, "the NVRTC worker pool's counters: processes started, requests answered and not, the executable, and why "
     "workers are not used ('' while they are), and the idle workers' pids");
  m.def(
      "compile_cubin",
      [](const std::string& source, const std::string& name, const std::string& arch, bool line_info) {
        KILN_CHECK(arch.rfind("sm_", 0) == 0) << "compile_cubin takes a real architecture like sm_90, not '" << arch
                                              << "'";
        return py::bytes(compile_for_python(source, name, arch, line_info).image);
      },
      py::arg("source"), py::arg("name"), py::arg("arch"), py::arg("line_info") = false,
      "compile a CUDA C program to a cubin (ELF bytes) for arch, e.g. 'sm_90'; needs no GPU");
  m.def("driver_available", &cg::driver_available, "True when libcuda opens and cuInit succeeds (never raises)");
  m.def("driver_library", &cg::driver_library_path, "the libcuda file in use ('' when none)");
  m.def(
      "compute_capability",
      [](int device) {
        cg::ComputeCapability cc = cg::compute_capability(device);
        return py::make_tuple(cc.major, cc.minor);
      },
      py::arg("device") = 0, "(major, minor) of a CUDA device, read through the driver API");
  m.def(
      "target_arch",
      [](int device) {
        cg::nvrtc_version();
        cg::ComputeCapability cc = cg::compute_capability(device);
        return cg::target_arch_for(cc.major, cc.minor);
      },
      py::arg("device") = 0, "what kiln compiles for on a device: 'sm_90' on H100/H200");
  m.def(
      "current_stream", [](int device) { return reinterpret_cast<uintptr_t>(rt::torch_current_stream(device)); },
      py::arg("device") = 0, "torch's current CUDA stream on a device as an int, read from C++ (no Python call)");
  m.def("launch_pointwise", &launch_pointwise, py::arg("source"), py::arg("kernel_name"), py::arg("tensors"),
        py::arg("n"), py::arg("block") = 256, py::arg("elements_per_thread") = 1, py::arg("stream") = py::none(),
        "compile (once per source and device) and launch `kernel_name(T* t0, ..., long long n)` over contiguous CUDA "
        "tensors with ceil(n / (block * elements_per_thread)) blocks, on torch's current stream (or `stream`, a "
        "cudaStream_t as int); asynchronous, no host synchronisation");
  m.def(
      "program_cache_stats",
      [] {
        cg::CudaProgramCacheStats s = cg::cuda_program_cache_stats();
        py::dict d;
        d["compiled"] = s.compiled;
        d["memory_hits"] = s.memory_hits;
        d["disk_hits"] = s.disk_hits;
        return d;
      },
      "programs compiled by NVRTC for launches, and launches the in-memory cache answered");
}

}  // namespace kiln::bindings
