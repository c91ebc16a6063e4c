#pragma once
// kiln's C++ loader of exported programs: runs a file that kiln.export's ExportedProgram.save wrote, in a program
// that links LibTorch and kiln's runtime but no Python.
//
//     #include <kiln/export.h>
//
//     kiln::ExportedProgram program = kiln::ExportedProgram::load("model.kiln");
//     std::vector<at::Tensor> outputs = program.run({at::randn({8, 16})});
//
// load() checks every entry of the file against the SHA-256 its manifest records (and the zip's CRC-32), reads the
// graph, the program's input specification and the weights. When the file holds compiled code for this machine
// (the same torch), the code runs through kiln's runtime as kiln.compile runs it: the C++ library (a CPU program) or
// the CUDA images (a CUDA program; NVRTC must be found, as kiln finds it, to key them) from the file are put into
// kiln's disk cache (KILN_CACHE_DIR, with the cache's ownership and permission checks) and loaded from there.
// Otherwise the graph runs on kiln's eager interpreter (ATen op by op), and fallback_reason() says why. Loading a file
// runs the compiled code it holds: load only files you trust.
//
// Link: kiln_export, kiln_runtime and kiln_base (static libraries of kiln's build) and LibTorch
// (examples/export_cpp/CMakeLists.txt shows how).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln {

/// What load() and run() throw for a file or inputs they cannot use: the message names the file or the input and
/// what was expected.
class ExportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A dim kiln.export's dynamic_shapes declared dynamic: run() takes any size in [min, max] there.
struct DynamicDim {
  int64_t dim = 0;
  std::string name;  // the torch.export.Dim's name; "" for Dim.DYNAMIC / Dim.AUTO. Dims of one name are equal.
  int64_t min = 2;   // sizes 0 and 1 are always specialised
  int64_t max = -1;  // -1: unbounded
};

/// One tensor argument as the program was exported: run() takes these dtypes and devices, and these sizes except in
/// the dynamic dims (sizes and strides are the example's).
struct TensorSpec {
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  std::vector<DynamicDim> dynamic;
};

class ExportedProgram {
 public:
  /// Reads the file ExportedProgram.save wrote; throws ExportError when it is missing, truncated or corrupted, was
  /// written by another format version, or holds a program this loader cannot run (a CUDA program without CUDA).
  static ExportedProgram load(const std::string& path);

  /// Runs the program on its tensor arguments, in the order of the Python call's arguments flattened (positional
  /// arguments, then keyword arguments in their order, each tuple, list and dict depth first; None, numbers and
  /// strings were specialised at export and are not passed). Returns the tensors of the result flattened the same
  /// way. Throws ExportError naming the argument (`inputs[0]: expected shape (4, 16), got (5, 16)`) when a tensor has
  /// another dtype, device or shape than input_specs() says: a static size that differs, a dynamic dim outside its
  /// range, dims sharing a Dim that differ. An input with other strides is copied to the exported layout.
  ///
  /// A dynamic program (exported with dynamic_shapes) runs at any sizes its specs allow: the file's compiled code at
  /// the export's sizes, and the graph specialised to each other binding of its size symbols on kiln's eager
  /// interpreter (this loader has no compiler pipeline; KILN_LOGS=dynamic names each binding).
  /// Inference only: no gradients are recorded. A CUDA program's kernels run on torch's current stream of its
  /// device and, as torch's own ops, may still be running when run() returns.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;

  const std::vector<TensorSpec>& input_specs() const;
  /// How many tensors run() returns.
  size_t num_outputs() const;
  /// "kiln" when the file's compiled code runs, "eager" when the graph runs on the eager interpreter.
  const std::string& backend() const;
  /// Why the program runs on the eager interpreter ("" when backend() is "kiln").
  const std::string& fallback_reason() const;
  /// The manifest's torch version, kiln version and devices, for messages.
  const std::map<std::string, std::string>& manifest() const;

  ExportedProgram(ExportedProgram&&) noexcept;
  ExportedProgram& operator=(ExportedProgram&&) noexcept;
  ~ExportedProgram();

 private:
  struct State;
  explicit ExportedProgram(std::unique_ptr<State> state);
  static std::unique_ptr<State> read(const std::string& path);
  std::unique_ptr<State> state_;
};

/// Tensors from a safetensors file (the layout weights.safetensors uses): {name: CPU tensor}. Throws ExportError.
std::map<std::string, at::Tensor> load_safetensors(const std::string& path);
/// Writes `tensors` (any device; copied to the CPU, contiguous) as a safetensors file. Throws ExportError.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors);

}  // namespace kiln
