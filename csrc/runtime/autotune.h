#pragma once
// Autotuning (mode="max-autotune", options={"autotune": True}): choosing between equivalent ways of running one step
// of a compiled graph by timing them on the device, at the graph's first call outside a CUDA graph capture.
//   - generated kernels: the schedules codegen offers for each (codegen/cuda tuning_candidates: block sizes, vector
//     widths, rows per block), compiled side by side in the graph's program;
//   - matmuls (extern mm/addmm/bmm/baddbmm): cuBLAS or cuBLASLt, through ATen's preferred BLAS backend;
//   - convolutions: cuDNN's own search (ATen's benchmark mode) while kiln's graphs run them.
// A choice is remembered for the process and in the disk cache (kind "tuned", keyed by what is chosen and the
// device), so a second process, or a second graph with the same kernel, times nothing. Candidate 0 is always what
// mode="default" runs, and another wins only by a margin (kMinGain): equal timings keep the default's choice.
// kernel_graph.cpp asks the questions; this file times, remembers and reports. Needs LibTorch only for the BLAS and
// cuDNN switches.
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "codegen/device_backend.h"

namespace kiln::runtime {

/// A candidate must be at least this much faster than candidate 0 to be chosen (timing noise stays the default).
constexpr double kMinGain = 0.03;

/// One choice: `key` (everything the answer depends on but the device; the caller's), `what` (for logs: "kernel_5",
/// "aten::mm.default"), and one label per candidate ("pointwise_vec4 block 512"), candidate 0 the default's.
struct TuneQuestion {
  std::string key;
  std::string what;
  std::vector<std::string> labels;
};

/// Times candidates on one device: `run(i)` launches candidate i once on `stream` (asynchronously); a candidate that
/// throws is skipped. Returns milliseconds per run (negative: it could not run).
class TuneTimer {
 public:
  TuneTimer(const codegen::DeviceBackend& backend, int index, void* stream)
      : backend_(backend), index_(index), stream_(stream) {}
  double time(const std::function<void()>& run) const;
  const codegen::DeviceBackend& backend() const { return backend_; }
  int index() const { return index_; }

 private:
  const codegen::DeviceBackend& backend_;
  int index_;
  void* stream_;
};

/// The candidate to run for `q` on the timer's device: remembered in this process or the disk cache, else each
/// candidate timed with `run` and the winner remembered in both. Progress is reported per `progress` (may be null).
class TuneProgress;
size_t choose(const TuneQuestion& q, const TuneTimer& timer, const std::function<void(size_t)>& run,
              TuneProgress* progress);

/// Progress of one graph's tuning: with KILN_LOGS=autotune a record per choice measured (count, what, the winner and
/// the default's time, elapsed and an estimate of the rest); on a terminal without that log, one line rewritten in
/// place once tuning has taken more than a second.
class TuneProgress {
 public:
  explicit TuneProgress(size_t questions) : total_(questions) {}
  ~TuneProgress();
  void measured(const TuneQuestion& q, size_t winner, const std::vector<double>& ms);
  void remembered() { ++done_; }

 private:
  size_t total_;
  size_t done_ = 0;
  bool line_open_ = false;
  double started_ms_ = now_ms();
  static double now_ms();
};

/// What the device's identity adds to every tuning key: its name and multiprocessors, and torch's version (cuBLAS and
/// cuDNN come with it).
std::string tuning_device_key(const codegen::DeviceBackend& backend, int index);

/// Extern ops whose candidates autotuning times or searches.
enum class ExternTuning : unsigned char {
  kNone,
  kBlas,   ///< matmul family, out of place: cuBLAS or cuBLASLt
  kCudnn,  ///< convolutions: ATen's cuDNN benchmark mode for the call
};
/// The tuning that applies to the op named `qualified` ("aten::addmm.default").
ExternTuning extern_tuning(const std::string& qualified);

/// Sets ATen's preferred BLAS backend (blas_choice 1: the library the preference does not resolve to, candidate 1 of
/// blas_candidate_labels; 0 or -1: as it is) or cuDNN's benchmark mode for
/// the guard's lifetime, restoring the previous setting. These are process-wide switches of ATen's context: a thread
/// running eager matmuls at the same moment sees them too.
class ExternChoiceGuard {
 public:
  ExternChoiceGuard(ExternTuning kind, int blas_choice);
  ~ExternChoiceGuard();
  ExternChoiceGuard(const ExternChoiceGuard&) = delete;
  ExternChoiceGuard& operator=(const ExternChoiceGuard&) = delete;

 private:
  ExternTuning kind_;
  int previous_ = -1;
  bool active_ = false;
};
/// The labels of the BLAS candidates, in ExternChoiceGuard's numbering.
std::vector<std::string> blas_candidate_labels();

}  // namespace kiln::runtime
