#pragma once
// Running what the pipeline compiled (compile/pipeline.h): a CompiledArtifact's device code loaded through its
// device backend (codegen/device_backend.h), and a flat run plan of kernel launches and extern ATen calls; plus the
// wrappers that run a graph's buffer updates and the eager interpreter kept for a graph kiln does not compile.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cache/compiled_artifact.h"
#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// The real constant tensors of a graph, indexed by ValueId (compile/backends.cpp owns the Python conversion).
using ConstantsOf = std::function<std::vector<at::Tensor>(const graph::Graph&)>;

/// How the layer that embeds kiln in an interpreter lets other threads run while make_kiln_graph loads code
/// (compilers run there): `release` returns a token (null: nothing was released) that `restore` takes back. The Python
/// module sets one that drops the GIL (bindings/); programs without Python leave it unset.
struct LoadUnlock {
  void* (*release)() = nullptr;
  void (*restore)(void*) = nullptr;
};
void set_load_unlock(LoadUnlock unlock);

/// Runs `artifact` on `device`: its code loaded (compiled, or found in the kernel caches) by the device backend that
/// emitted it, with `load_context` (what the binary depends on beyond its source), and its run plan built. Call with
/// the GIL held, if any (set_load_unlock's hook releases it while compilers run). `dump_dir`: where the source and
/// graph are written, or "".
/// `folded`: the constant-folding lines for the summary. `autotune` (CUDA): the first call outside a CUDA graph capture
/// times the kernels' schedule variants (cache::KernelEntry::variants) and the matmuls' BLAS libraries and keeps the
/// fastest, and convolutions run with cuDNN's search (runtime/autotune.h).
std::shared_ptr<CompiledGraph> make_kiln_graph(cache::CompiledArtifact artifact, const graph::Device& device,
                                               const ConstantsOf& constants_of, const std::string& load_context,
                                               const std::string& dump_dir, std::vector<std::string> folded,
                                               bool autotune = false);

/// The eager interpreter for a graph kiln does not compile, with `reason` and `folded` in its summary.
std::shared_ptr<CompiledGraph> make_fallback_graph(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants,
                                                   std::string reason, std::vector<std::string> folded);

/// A graph whose in-place updates of inputs were made functional (passes/functionalize_buffer_updates.h): `inner`
/// returns the graph's `num_outputs` outputs, then one final value per entry of `updated_inputs`, which this copies
/// into the caller's tensors, as eager's in-place ops would have left them (same storage, version counter bumped).
std::shared_ptr<CompiledGraph> make_buffer_updating_graph(std::shared_ptr<CompiledGraph> inner,
                                                          std::vector<int32_t> updated_inputs, size_t num_outputs);

/// `inner` (a graph that updates the inputs `updated` in place), run on `eager` for a call where another input
/// shares memory with an updated one (a view of it passed alongside): eager's in-place op shows through that view,
/// while the compiled graph reads each input as its own buffer.
std::shared_ptr<CompiledGraph> make_alias_checked_graph(std::shared_ptr<CompiledGraph> inner,
                                                        std::shared_ptr<CompiledGraph> eager, std::vector<int32_t> updated);

/// What the kiln backend made of a graph, for tests and tools.
struct KilnGraphSummary {
  std::string backend;          // "kiln" (kernels) or "eager" (fell back)
  std::string fallback_reason;  // why it fell back, "" otherwise
  std::vector<std::string> kernels;  // kernel names in execution order
  std::vector<std::string> externs;  // op overloads of extern calls, in order
  std::vector<std::string> plan;     // the run plan's steps in order: a kernel's (or launch group's) name, an extern's op
  std::string source;                // the generated C++ or CUDA C ("" on fallback)
  std::string device;                // "cpu" or "cuda:N" ("" on fallback)
  std::vector<std::string> strategies;  // CUDA: per kernel, how it maps onto threads (emit_cuda.h)
  std::vector<std::string> in_place;    // "kernel: %out into %in" for outputs that may take an input's storage
  std::vector<std::string> folded;      // "%7 = f32[8, 8] from aten::triu.default": values computed at compile time
};

/// The summary of a graph compiled by the kiln backend, or nullptr for any other CompiledGraph.
const KilnGraphSummary* kiln_graph_summary(const CompiledGraph& compiled);

/// Process-wide counters of the kiln backend (graphs compiled, fallbacks).
struct KilnBackendStats {
  int64_t graphs_compiled = 0;
  int64_t graphs_fallback = 0;
  int64_t graphs_autograd = 0;  // graphs compiled as forward + backward behind one autograd node
  int64_t autograd_saved_bytes = 0;       // summed over those graphs: bytes of saved forward intermediates
  int64_t autograd_recomputed_nodes = 0;  // summed over those graphs: forward nodes the backward recomputes
  int64_t autograd_backward_variants = 0;  // backward graphs compiled again without gradients that did not come
  int64_t graphs_split = 0;  // training graphs cut at a data-parallel wrapper's gradient buckets (DDP)
  int64_t split_pieces = 0;  // summed over those graphs: the pieces each was cut into
  std::string last_fallback_reason;
  // graphs_fallback and the last reason since kiln.reset() (kiln.stats()' graphs_on_eager_interpreter)
  int64_t fallbacks_since_reset = 0;
  std::string fallback_reason_since_reset;
};
KilnBackendStats& kiln_backend_stats();

}  // namespace kiln::runtime
