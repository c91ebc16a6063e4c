#pragma once
// Device backends (DESIGN.md "Backends plug in by table"): one implementation per device type, registered by that
// type, each owning the three device-specific steps of the pipeline:
//   emit  -- a schedule's kernels as this device's source (cache::DeviceCode, part of the device-neutral artefact);
//   load  -- that source compiled, or found in the kernel cache, and loaded into this process;
//   run   -- one loaded kernel over its buffers.
// The pipeline (compile/pipeline.h) calls emit, the runtime (runtime/kernel_graph.h) calls load and run: neither
// tests which device it serves. CPU: C++/OpenMP through the system compiler (codegen/cpp); CUDA: CUDA C through
// NVRTC, launched with the driver API (codegen/cuda). Torch-free.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "cache/compiled_artifact.h"
#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::codegen {

/// One kernel of a loaded program, bound for the run plan.
class LoadedKernel {
 public:
  virtual ~LoadedKernel() = default;
  /// Runs the kernel over `buffers` (its buffers' data pointers, in the kernel's order) on `stream` (CUDA: the
  /// driver stream the caller computes on, torch's current one; null on the CPU). Asynchronous on CUDA. Returns false when
  /// a gathered load met an index out of range (the caller raises eager's IndexError).
  virtual bool run(void* const* buffers, size_t count, void* stream) const = 0;
};

/// A device program loaded into this process.
class LoadedCode {
 public:
  virtual ~LoadedCode() = default;
  /// The kernel `entry` names (one of DeviceCode::kernels, or its group). `gathers`: the kernel has gathered loads
  /// whose indices are checked at run time. Throws kiln::Error when the program lacks it.
  virtual std::unique_ptr<LoadedKernel> kernel(const cache::KernelEntry& entry, bool gathers) const = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  /// The name DeviceCode::backend records ("cpp", "cuda").
  virtual const char* name() const = 0;
  /// The kernels of `schedule` as this device's code, one KernelEntry per schedule kernel. The backend may
  /// regroup the schedule first (CUDA runs pointwise kernels that read only graph inputs as one launch;
  /// `keep_peak`: not where that would raise the graph's peak memory). Throws kiln::Error for a construct it has
  /// no code for (the graph then runs on the eager interpreter). `size_arguments`: kernels read their sizes at run time
  /// (codegen/size_arguments.h; DeviceCode::size_arguments, KernelEntry::sizes). `tune` (mode="max-autotune"): kernels
  /// also come with alternatives to time (KernelEntry::variants, tune_key) where the backend has any (CUDA; the CPU
  /// backend has none and ignores it).
  virtual cache::DeviceCode emit(fusion::Schedule& schedule, const graph::Graph& g, bool keep_peak, bool size_arguments,
                                 bool tune) const = 0;
  /// `code` compiled (or found in the kernel cache) and loaded for device `index`; `context` names what the binary
  /// depends on beyond the source (torch's version). Call without the GIL: compilers run here.
  virtual std::shared_ptr<const LoadedCode> load(const cache::DeviceCode& code, int index,
                                                 const std::string& context) const = 0;
  /// Work to do with the GIL held before load() (CUDA: NVRTC is found through importlib on first use).
  virtual void prepare_load() const {}
  /// The streaming multiprocessors of device `index` (CUDA), which decide how matmul epilogues are split
  /// (passes/split_addmm.h) and so are part of cache keys; 0 where the notion does not apply (CPU).
  virtual int multiprocessors(int index) const { return 0; }
  /// The product name of device `index` (autotuning's cache keys: timings belong to one kind of device); "" on the
  /// CPU, whose kernels are not tuned.
  virtual std::string device_name(int index) const { return ""; }
  /// Autotuning: runs `work` (launches on `stream` of device `index`) `reps` times and returns the mean milliseconds
  /// per run, as the device measures it (CUDA: events recorded on `stream` around the runs; this waits for them).
  /// The default, for devices whose work is done when `work` returns (CPU), is the wall clock.
  virtual double time_ms(const std::function<void()>& work, int index, void* stream, int reps) const;
  /// Whether `stream` is being captured (a CUDA graph): nothing may be timed, synchronised or launched for trial then.
  /// CPU: never.
  virtual bool capturing(void* stream) const { return false; }
};

/// The backend registered for `type`; throws kiln::Error (Unsupported) for a device kiln generates no code for.
const DeviceBackend& device_backend(graph::DeviceType type);
/// The backend that emitted `code` (DeviceCode::backend); throws kiln::Error for an unknown name.
const DeviceBackend& device_backend_named(const std::string& name);

}  // namespace kiln::codegen
