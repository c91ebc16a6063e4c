#pragma once
// A pool of NVRTC worker processes (kiln-nvrtc-worker, csrc/tools/nvrtc_worker.cpp) for compiling the parts of
// one CUDA source side by side. Threads suffice where NVRTC overlaps programs; on machines where it compiles one
// program at a time per process (an H100 host did), only processes overlap. Workers start on first use, beside
// the kiln module, and live until the process ends (a worker exits when its socket closes).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "codegen/cuda/nvrtc_worker_protocol.h"

namespace kiln::codegen::cuda {

/// NVRTC's answer to `request` from an idle worker (one is started when none is idle, up to one per core, at
/// most 8). nullopt when no worker could answer: the executable is missing or would not start, the worker died
/// mid-request (it is then retired), every worker is busy, or this process was forked from the one that started
/// them; the caller compiles in its own process instead. Thread-safe.
std::optional<nvrtc_worker::Response> compile_in_worker(const nvrtc_worker::Request& request);

struct NvrtcWorkerStats {
  int64_t started = 0;      // worker processes started
  int64_t answered = 0;     // requests a worker answered (compile errors included)
  int64_t failed = 0;       // requests no worker could answer
  std::string executable;   // the worker's path ("" until first use)
  std::string unavailable;  // why workers are not used ("" while they are)
  std::vector<int> idle_pids;  // the workers waiting for a request
};
NvrtcWorkerStats nvrtc_worker_stats();

}  // namespace kiln::codegen::cuda
