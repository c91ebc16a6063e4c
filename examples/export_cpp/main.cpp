// Loads a file kiln.export's ExportedProgram.save wrote and runs it, without Python (examples/export_cpp/README.md).
//
//   kiln_export_example MODEL.kiln [--inputs IN.safetensors] [--outputs OUT.safetensors] [--iterations N]
//
// Inputs come from IN.safetensors (tensors "input.0", "input.1", ...: the program's tensor arguments in order), or
// are random tensors of the exported shapes. Prints the load time, the first call's time, the steady time per call
// and each output's shape; writes the outputs as "output.0", ... to OUT.safetensors. Exit status 1 on an error.
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <kiln/export.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// CUDA programs run asynchronously on the current stream: a call's time counts until its kernels have finished.
std::vector<at::Tensor> finished(std::vector<at::Tensor> outputs) {
  for (const at::Tensor& t : outputs)
    if (t.is_cuda()) {
      const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      cuda->synchronizeStream(cuda->getStream(t.device()));
      break;
    }
  return outputs;
}

std::vector<at::Tensor> random_inputs(const kiln::ExportedProgram& program) {
  std::vector<at::Tensor> inputs;
  for (const kiln::TensorSpec& spec : program.input_specs()) {
    const auto options = at::TensorOptions().dtype(spec.dtype).device(spec.device);
    inputs.push_back(at::isFloatingType(spec.dtype) ? at::randn(spec.sizes, options)
                                                    : at::randint(0, 2, spec.sizes, options));
  }
  return inputs;
}

std::vector<at::Tensor> file_inputs(const kiln::ExportedProgram& program, const std::string& path) {
  std::map<std::string, at::Tensor> tensors = kiln::load_safetensors(path);
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < program.input_specs().size(); ++i) {
    auto it = tensors.find("input." + std::to_string(i));
    if (it == tensors.end()) throw kiln::ExportError(path + " has no tensor input." + std::to_string(i));
    inputs.push_back(it->second.to(program.input_specs()[i].device));
  }
  return inputs;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, inputs_path, outputs_path;
  int iterations = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--inputs" && i + 1 < argc) inputs_path = argv[++i];
    else if (arg == "--outputs" && i + 1 < argc) outputs_path = argv[++i];
    else if (arg == "--iterations" && i + 1 < argc) iterations = std::max(0, std::atoi(argv[++i]));
    else if (model.empty() && arg.rfind("--", 0) != 0) model = arg;
    else {
      std::cerr << "usage: " << argv[0]
                << " MODEL.kiln [--inputs IN.safetensors] [--outputs OUT.safetensors] [--iterations N]\n";
      return 2;
    }
  }
  if (model.empty()) {
    std::cerr << "usage: " << argv[0] << " MODEL.kiln [--inputs IN.safetensors] [--outputs OUT.safetensors]\n";
    return 2;
  }
  try {
    auto start = std::chrono::steady_clock::now();
    kiln::ExportedProgram program = kiln::ExportedProgram::load(model);
    const double load_ms = ms_since(start);
    std::cout << "loaded " << model << " in " << load_ms << " ms: backend " << program.backend();
    if (!program.fallback_reason().empty()) std::cout << " (" << program.fallback_reason() << ")";
    std::cout << "\n";

    std::vector<at::Tensor> inputs = inputs_path.empty() ? random_inputs(program) : file_inputs(program, inputs_path);
    start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> outputs = finished(program.run(inputs));
    std::cout << "first call: " << ms_since(start) << " ms\n";
    std::vector<double> times;
    for (int i = 0; i < iterations; ++i) {
      start = std::chrono::steady_clock::now();
      finished(program.run(inputs));
      times.push_back(ms_since(start));
    }
    if (!times.empty()) {
      std::sort(times.begin(), times.end());
      std::cout << "steady: median " << times[times.size() / 2] << " ms per call over " << times.size() << " calls\n";
    }
    std::map<std::string, at::Tensor> named;
    for (size_t i = 0; i < outputs.size(); ++i) {
      std::cout << "output " << i << ": " << outputs[i].scalar_type() << " " << outputs[i].sizes() << "\n";
      named["output." + std::to_string(i)] = outputs[i];
    }
    if (!outputs_path.empty()) kiln::save_safetensors(outputs_path, named);
  } catch (const kiln::ExportError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
