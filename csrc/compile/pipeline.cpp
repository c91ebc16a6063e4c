// The pipeline (pipeline.h), read top to bottom: compile_kiln_graph decides what a captured graph needs
// (functional form, folded constants, a forward/backward split, or the eager interpreter), lower_graph is the
// straight-line lowering of one graph to a CompiledArtifact, and compile_artifact finds that artefact in the graph
// cache or lowers and stores it, then hands it to runtime/ to load and run.
#include "compile/pipeline.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include <c10/core/GradMode.h>

#include "cache/graph_cache.h"
#include "cache/kernel_cache.h"
#include "codegen/cuda/cuda_device_lib.h"
#include "codegen/cuda/nvrtc_compiler.h"
#include "codegen/device_backend.h"
#include "common/error.h"
#include "common/log.h"
#include "common/progress.h"
#include "compile/fold_graph_constants.h"
#include "compile/meta_oracle.h"
#include "compile/split_for_autodiff.h"
#include "graph/graph_device.h"
#include "fusion/in_place_outputs.h"
#include "fusion/schedule_kernels.h"
#include "passes/channels_last.h"
#include "passes/functionalize.h"
#include "passes/functionalize_buffer_updates.h"
#include "passes/graph_rewriter.h"
#include "passes/lower_batch_norm.h"
#include "passes/lower_attention.h"
#include "passes/lower_cross_entropy.h"
#include "passes/pipeline.h"
#include "passes/sink_into_copies.h"
#include "passes/split_at_parameter_buckets.h"
#include "passes/split_addmm.h"
#include "passes/stage_row_sums.h"
#include "passes/use_cudnn_batch_norm.h"
#include "runtime/chained_graph.h"
#include "runtime/cuda_graphs.h"
#include "runtime/drop_attention_masks.h"
#include "runtime/double_backward.h"
#include "runtime/eager_interpreter.h"
#include "runtime/torch_info.h"

namespace kiln::compile {

namespace {

std::atomic<bool> g_compiled_autograd{true};
std::atomic<bool> g_cuda_ptx_check{false};

CudaPtxCheck& ptx_check_state() {
  static CudaPtxCheck state;
  return state;
}

// True when the graph must record autograd history: grad mode on and some value requires grad.
bool needs_autograd(const graph::Graph& g) {
  if (!at::GradMode::is_enabled()) return false;
  for (const graph::Value& v : g.values)
    if (v.meta.requires_grad) return true;
  return false;
}

// `g` without its kiln::set_grad_enabled nodes (itself when it has none).
std::shared_ptr<const graph::Graph> without_grad_mode_switches(std::shared_ptr<const graph::Graph> g) {
  auto is_switch = [](const graph::Node& node) { return node.op == "kiln::set_grad_enabled"; };
  if (std::none_of(g->nodes.begin(), g->nodes.end(), is_switch)) return g;
  auto stripped = std::make_shared<graph::Graph>(*g);
  passes::GraphRewriter rewriter(*stripped);
  for (graph::Node& node : rewriter.take_nodes())
    if (!is_switch(node)) rewriter.append(std::move(node));
  return stripped;
}

// True when the graph computes nothing: no node, or views of its inputs alone (a resume function that returns what the
// eager call before it gave, as around each FSDP2 module that runs eagerly). Nothing to compile or differentiate.
bool views_only(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes)
    if (!node.is_view || node.mutates_args) return false;
  return true;
}

// The device all of the graph's tensors live on, when kiln generates code for it (CPU, or one CUDA device), or
// nullopt with `why` set.
std::optional<graph::Device> graph_device(const graph::Graph& g, std::string& why) {
  const std::vector<bool> used = graph::used_values(g);
  for (const graph::Value& v : g.values) {
    const graph::DeviceType type = v.meta.device.type;
    if (v.is_tensor && used[v.id] && type != graph::DeviceType::CPU && type != graph::DeviceType::CUDA) {
      why = "tensors on " + graph::device_type_name(type) + " (kiln generates code for CPU and CUDA)";
      return std::nullopt;
    }
  }
  return graph::single_device(g, why);
}

// Why `g` must stay on the eager interpreter, or "".
std::string unsupported_reason(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes)
    if (node.mutates_args) return "in-place op " + node.qualified_name();
  std::string why;
  graph_device(g, why);
  return why;
}

// The test suite's check that CUDA code generation works for every graph it compiles on CPU: the same schedule
// emitted as CUDA C (with max-autotune's variants where the options tune) and compiled to PTX by NVRTC (no GPU needed). Failures are recorded, not thrown: the CPU graph
// itself is fine.
void check_cuda_ptx(const fusion::Schedule& schedule, const graph::Graph& g, bool size_arguments, bool tune) {
  if (!g_cuda_ptx_check) return;
  CudaPtxCheck& state = ptx_check_state();
  std::string source;
  try {
    fusion::Schedule grouped = schedule;  // the launch group's code is checked too
    const codegen::DeviceBackend& cuda = codegen::device_backend(graph::DeviceType::CUDA);
    const cache::DeviceCode code = cuda.emit(grouped, g, /*keep_peak=*/false, size_arguments, tune);
    source = code.source();
    KILN_LOG(output_code) << "kiln backend, PTX check of the same schedule as CUDA C:\n" << source;
    codegen::cuda::NvrtcOptions options;
    options.arch = "compute_90";
    options.headers = codegen::cuda::cuda_device_headers();
    for (const std::string& part : code.parts) codegen::cuda::compile_cuda(part, "kiln_ptx_check", options);
    state.compiled++;
  } catch (const std::exception& e) {
    state.failures.push_back(std::string(e.what()) + "\n--- source ---\n" + source);
  }
}

// "N kernels, M extern calls" of an artefact's run plan, for KILN_LOGS=perf.
std::string plan_counts(const cache::CompiledArtifact& artifact) {
  size_t externs = 0;
  for (const fusion::Step& step : artifact.steps) externs += step.kind == fusion::Step::Kind::Extern;
  return std::to_string(artifact.kernels.size()) + " kernels, " + std::to_string(externs) + " extern calls";
}

// `compiled` replayed as a CUDA graph when the options ask for CUDA graphs and it runs on a CUDA device
// (runtime/cuda_graphs.h), else `compiled` itself. Graphs on the CPU are not wrapped: their status says why.
std::shared_ptr<runtime::CompiledGraph> with_cuda_graphs(std::shared_ptr<runtime::CompiledGraph> compiled,
                                                         const graph::Graph& g, const graph::Device& device,
                                                         const CompileOptions& options, size_t escaping,
                                                         bool training_half) {
  if (!options.cuda_graph_pool) return compiled;
  std::string declined;
  if (device.type != graph::DeviceType::CUDA) declined = "its tensors are on the CPU (CUDA graphs replay CUDA work only)";
  // A value on the host (a CPU scalar, the random seed efficient attention returns) would be computed once, while
  // recording, and never again: a replay runs only the device's work.
  for (const graph::Node& node : g.nodes)
    for (graph::ValueId out : node.outputs)
      if (declined.empty() && g.values[out].is_tensor && g.values[out].meta.device.type != graph::DeviceType::CUDA)
        declined = node.qualified_name() + " makes a tensor on the host, which a replay would not recompute";
  // One launch costs the same as the replay of a graph of it, and the replay's outputs are then copied out of the
  // graph's memory (runtime/cuda_graphs.h): a pointwise graph over 10M elements took 0.38 ms replayed against 0.20 ms.
  if (const runtime::KilnGraphSummary* summary = runtime::kiln_graph_summary(*compiled);
      declined.empty() && summary && summary->backend == "kiln" && summary->plan.size() <= 1)
    declined = "it is a single launch: replaying it as a CUDA graph saves nothing, and copying its outputs out costs";
  return runtime::make_cuda_graph_runner(
      std::move(compiled), options.cuda_graph_pool, escaping,
      training_half ? (escaping == SIZE_MAX ? "backward graph" : "forward graph") : "graph", declined);
}

// A lowering's artefact, found in the graph cache when one was stored under the same key, else lowered and stored;
// then loaded and run by runtime/. `training_half`: the graph is the forward or backward of a compiled training step.
std::shared_ptr<runtime::CompiledGraph> compile_artifact(std::shared_ptr<const graph::Graph> captured,
                                                         const runtime::ConstantsOf& constants_of,
                                                         const CompileOptions& options, bool training_half,
                                                         std::vector<std::string> folded, size_t escaping) {
  const log::Stopwatch started;
  std::string why;
  const graph::Device device = *graph_device(*captured, why);  // checked by unsupported_reason
  const codegen::DeviceBackend& backend = codegen::device_backend(device.type);
  const std::string load_context = "torch " + runtime::built_torch_version();
  std::string context = load_context + (training_half ? ", training half" : "") + ", " + options.cache_key();
  if (const int sms = backend.multiprocessors(std::max<int>(device.index, 0)); sms > 0)
    context += ", " + std::string(backend.name()) + " with " + std::to_string(sms) + " SMs";
  const std::optional<std::string> key = cache::graph_key(*captured, context);
  // The PTX check (a test switch) needs the schedule, so it always lowers.
  std::optional<cache::CompiledArtifact> cached =
      g_cuda_ptx_check || !key ? std::nullopt : cache::load_artifact(*key, *captured);
  if (cached) {
    progress::stage("load");
    const double read_ms = started.ms();
    const std::string counts = plan_counts(*cached);
    auto compiled = runtime::make_kiln_graph(std::move(*cached), device, constants_of, load_context, options.dump_dir(),
                                             std::move(folded), options.tunes());
    cache::stats().graph_hits++;
    KILN_LOG(perf) << "kiln backend: found in the graph cache (" << counts << "); read "
                   << log::whole_ms(read_ms) << " ms, compiler or cache " << log::whole_ms(started.ms() - read_ms) << " ms";
    return with_cuda_graphs(std::move(compiled), *captured, device, options, escaping, training_half);
  }
  if (options.tunes() && device.type != graph::DeviceType::CUDA)
    KILN_LOG(autotune) << "a graph on the " << graph::device_type_name(device.type)
                       << ": kiln has no tuning candidates there; it compiles as in mode='default'";
  LoweringTimes times;
  cache::CompiledArtifact artifact = lower_graph(*captured, device, options, training_half, times);
  if (key) cache::store_artifact(*key, artifact);
  const std::string counts = plan_counts(artifact);
  const double lowered_ms = started.ms();
  auto compiled = runtime::make_kiln_graph(std::move(artifact), device, constants_of, load_context, options.dump_dir(),
                                           std::move(folded), options.tunes());
  KILN_LOG(perf) << "kiln backend: " << counts << "; passes and fusion " << log::whole_ms(times.passes_ms)
                 << " ms, code generation " << log::whole_ms(times.emit_ms) << " ms, compiler or cache "
                 << log::whole_ms(started.ms() - lowered_ms) << " ms";
  return with_cuda_graphs(std::move(compiled), *captured, device, options, escaping, training_half);
}

// A graph whose only in-place ops update inputs that need no grad (BatchNorm's num_batches_tracked): compiled with
// the updates made functional, their final values written back after it runs. Null when its in-place ops are not
// all such updates (passes/functionalize_buffer_updates.h).
std::shared_ptr<runtime::CompiledGraph> compile_with_buffer_updates(const std::shared_ptr<const graph::Graph>& g,
                                                                    const runtime::ConstantsOf& constants_of,
                                                                    const CompileOptions& options, bool training_half) {
  auto functional = std::make_shared<graph::Graph>(*g);
  std::vector<passes::BufferUpdate> updates;
  try {
    updates = passes::functionalize_buffer_updates(*functional);
  } catch (const std::exception&) {
    return nullptr;
  }
  if (updates.empty() || !unsupported_reason(*functional).empty()) return nullptr;
  const size_t num_outputs = functional->outputs.size();
  std::vector<graph::ValueId> outputs = functional->outputs;
  std::vector<int32_t> updated;
  for (const passes::BufferUpdate& update : updates) {
    outputs.push_back(update.final_value);
    updated.push_back(update.input_index);
  }
  functional->set_outputs(outputs);
  if (passes::verify_enabled()) functional->verify();
  try {
    // The updated values are written back as soon as the graph returns: only the first outputs reach the caller.
    auto compiled = compile_artifact(functional, constants_of, options, training_half, {}, num_outputs);
    runtime::kiln_backend_stats().graphs_compiled++;
    auto updating = runtime::make_buffer_updating_graph(std::move(compiled), updated, num_outputs);
    return runtime::make_alias_checked_graph(std::move(updating), runtime::make_eager_interpreter(g, constants_of(*g)),
                                             std::move(updated));
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln backend: a graph with buffer updates: " << e.what();
    return nullptr;
  }
}

// `g` with its training-mode batch norms on cuDNN where eager would run them there (passes/use_cudnn_batch_norm.h),
// or `g` itself when none qualifies: for the eager interpreter, whose replay then records eager's own autograd nodes.
std::shared_ptr<const graph::Graph> with_cudnn_batch_norm(std::shared_ptr<const graph::Graph> g) {
  const passes::CudnnBatchNorm cudnn = cudnn_batch_norm_here();
  if (!cudnn.available) return g;
  auto rewritten = std::make_shared<graph::Graph>(*g);
  std::unique_ptr<graph::OpOracle> oracle = make_meta_oracle();
  at::NoGradGuard no_grad;
  if (!passes::use_cudnn_batch_norm(*rewritten, *oracle, cudnn)) return g;
  return rewritten;
}

// A training graph inside a DDP forward cut at DDP's gradient buckets (passes/split_at_parameter_buckets.h), each
// piece compiled on its own through compile_kiln_graph (a piece that needs grad gets its own autograd node), chained
// by runtime/. Null when the options name no buckets or the graph holds one bucket's worth or less.
std::shared_ptr<runtime::CompiledGraph> compile_in_buckets(const std::shared_ptr<const graph::Graph>& g,
                                                           const runtime::ConstantsOf& constants_of,
                                                           const CompileOptions& options) {
  if (!options.parameter_buckets) return nullptr;
  passes::SplitGraph split = passes::split_at_parameter_buckets(*g, *options.parameter_buckets);
  if (split.pieces.size() < 2) return nullptr;
  CompileOptions piece_options = options;
  piece_options.parameter_buckets = nullptr;  // each piece compiles whole
  std::vector<runtime::ChainLink> links;
  std::string bytes;
  for (passes::GraphPiece& piece : split.pieces) {
    if (passes::verify_enabled()) piece.graph->verify();
    const size_t num_outputs = piece.graph->outputs.size();
    const progress::Part part("bucket piece");
    links.push_back({compile_kiln_graph(std::move(piece.graph), constants_of, piece_options), std::move(piece.input_slots),
                     num_outputs});
    bytes += (bytes.empty() ? "" : ", ") + std::to_string(piece.parameter_bytes);
  }
  KILN_LOG(graph) << "kiln backend: graph cut at DDP's gradient buckets into " << links.size()
                  << " pieces holding " << bytes << " bytes of parameters";
  runtime::kiln_backend_stats().graphs_split++;
  runtime::kiln_backend_stats().split_pieces += static_cast<int64_t>(links.size());
  return runtime::make_chained_graph(std::move(links), g->inputs.size(), std::move(split.output_slots));
}

}  // namespace

cache::CompiledArtifact lower_graph(const graph::Graph& captured, const graph::Device& device,
                                    const CompileOptions& options, bool training_half, LoweringTimes& times) {
  const log::Stopwatch started;
  const codegen::DeviceBackend& backend = codegen::device_backend(device.type);
  cache::CompiledArtifact artifact;
  artifact.optimised = captured;
  graph::Graph& g = artifact.optimised;
  progress::stage("passes");
  // Inference batch norm first: it becomes pointwise ops that every later pass sees as such. So does cross entropy
  // (a training half's was lowered before autodiff already: autodiff/build_joint_graphs.cpp).
  passes::run_pass("lower_inference_batch_norm", g, passes::lower_inference_batch_norm);
  passes::run_pass("lower_cross_entropy", g, [](graph::Graph& graph) {
    if (!passes::has_cross_entropy(graph)) return false;
    std::unique_ptr<graph::OpOracle> oracle = make_meta_oracle();
    at::NoGradGuard no_grad;
    return passes::lower_cross_entropy(graph, *oracle);
  });
  passes::run_pass("attention_masks_as_biases", g, [](graph::Graph& graph) {
    if (!passes::has_attention_mask_to_convert(graph)) return false;
    std::unique_ptr<graph::OpOracle> oracle = make_meta_oracle();
    at::NoGradGuard no_grad;
    return passes::attention_masks_as_biases(graph, *oracle);
  });
  // A matmul's bias add moves into the kernel that reads the product, where the device has the multiprocessors to
  // make that pay (CUDA); before the layout passes, which see the plain matmul.
  if (const int sms = backend.multiprocessors(std::max<int>(device.index, 0)); sms > 0)
    passes::run_pass("split_addmm_bias", g, [sms](graph::Graph& graph) { return passes::split_addmm_bias(graph, sms); });
  passes::run_pass("sink_pointwise_into_copies", g, passes::sink_pointwise_into_copies);
  passes::run_pass("stage_row_sums", g, passes::stage_row_sums);
  // Convolutions channels-last after the rewrites above; CPU convolutions of a training step keep their layout
  // (passes/channels_last.h).
  passes::run_pass("relayout_convolutions_channels_last", g, [training_half](graph::Graph& graph) {
    return passes::relayout_convolutions_channels_last(graph, /*cpu=*/!training_half);
  });
  // The generic clean-ups last, over everything the rewrites above left (passes/pipeline.cpp).
  passes::run_graph_passes(g);
  progress::stage("fusion");
  fusion::Schedule schedule = fusion::schedule_kernels(g);
  if (passes::verify_enabled())
    for (const auto& k : schedule.kernels) fusion::verify_kernel(k);
  times.passes_ms = started.ms();
  bool has_kernels = false;
  for (const auto& step : schedule.steps) has_kernels = has_kernels || step.kind == fusion::Step::Kind::Kernel;
  if (has_kernels) {
    progress::stage("codegen");
    // A training half's launch groups never raise the graph's peak of live bytes.
    artifact.code = backend.emit(schedule, g, /*keep_peak=*/training_half, options.size_arguments, options.tunes());
    if (device.type == graph::DeviceType::CPU) check_cuda_ptx(schedule, g, options.size_arguments, options.tunes());
  }
  times.emit_ms = started.ms() - times.passes_ms;
  KILN_LOG(output_code) << "kiln backend: " << schedule.summary();
  artifact.steps = schedule.steps;
  for (const fusion::Kernel& k : schedule.kernels)
    artifact.kernels.push_back({k.name, k.buffers, fusion::in_place_sources(k), k.checks_indices()});
  // Constants by the captured graph's ids (passes may renumber values), so an artefact read back finds its tensors.
  artifact.constant_sources = cache::constant_sources(captured, g);
  return artifact;
}

std::shared_ptr<runtime::CompiledGraph> compile_kiln_graph(std::shared_ptr<const graph::Graph> g,
                                                           const runtime::ConstantsOf& constants_of,
                                                           const CompileOptions& options, bool training_half,
                                                           size_t escaping) {
  progress::stage("passes");
  // 1. Functionalize: in-place ops on the graph's own intermediates become functional (passes/functionalize.h).
  bool mutates = false;
  for (const graph::Node& node : g->nodes) mutates = mutates || node.mutates_args;
  if (mutates) {
    auto functional = std::make_shared<graph::Graph>(*g);
    if (passes::functionalize_inplace_ops(*functional)) {
      if (passes::verify_enabled()) functional->verify();
      g = std::move(functional);
    }
  }
  // 2. Fold: after functionalization, so a mask built in place (`torch.full(...).triu_(1)`) is functional by now.
  std::vector<std::string> folded;
  g = fold_graph_constants(std::move(g), constants_of, folded);
  // Then attention masks that mask nothing are dropped: after folding, which may have made the mask a constant. The
  // C++ loader of exported programs (csrc/export) repeats steps 1 and 2 to find the graph the artefact is keyed by.
  g = runtime::drop_attention_masks_that_mask_nothing(std::move(g), constants_of);
  // 3. What the graph needs: a forward/backward split, buffer updates, or the plain lowering.
  std::string reason;
  if (views_only(*g) && needs_autograd(*g)) {
    // Eager's own views (storage, version counter, autograd history) are what the caller must get: the eager
    // interpreter replays them. By design, so not counted as a fallback.
    std::vector<at::Tensor> constants = constants_of(*g);
    auto views = runtime::make_fallback_graph(std::move(g), std::move(constants), "views of the inputs only",
                                              std::move(folded));
    if (!options.cuda_graph_pool) return views;
    return runtime::make_cuda_graph_runner(std::move(views), options.cuda_graph_pool, escaping, "graph",
                                           "it only views its inputs (nothing to launch)");
  }
  if (runtime::needs_eager_for_grad_mode(*g)) {
    reason = "the graph switches grad mode over values that require grad (eager_interpreter.h)";
  } else if (needs_autograd(*g) && !compiled_autograd()) {
    reason = "the graph needs grad (compiled autograd is off: kiln.config.set_compiled_autograd)";
  } else if (needs_autograd(*g)) {
    // No_grad blocks (what needs_eager_for_grad_mode let through) are in the metas already; the halves run with grad
    // off, so their switches go. The interpreter below, for aliased calls, replays the graph with them.
    std::shared_ptr<const graph::Graph> differentiated = without_grad_mode_switches(g);
    // Inside a DDP forward, one piece per gradient bucket, each going through this pipeline again; a failure to cut
    // compiles the graph whole, which only gives up the overlap.
    try {
      if (auto chained = compile_in_buckets(differentiated, constants_of, options)) return chained;
    } catch (const std::exception& e) {
      KILN_LOG(fallbacks) << "kiln backend: not cut at DDP's buckets, compiled whole: " << e.what();
    }
    // Forward and backward compiled ahead of time behind one autograd node; each half goes through this pipeline
    // again. Anything autodiff does not cover keeps the eager interpreter, which records eager's autograd history
    // op by op.
    try {
      auto joint = split_for_autodiff(differentiated, [constants_of, options](std::shared_ptr<const graph::Graph> part,
                                                                              size_t part_escaping) {
        at::AutoGradMode no_grad(false);  // the halves run with grad off: compile them as such
        return compile_kiln_graph(std::move(part), constants_of, options, /*training_half=*/true, part_escaping);
      }, std::make_shared<runtime::DoubleBackwardReplay>(g, constants_of(*g)));
      runtime::kiln_backend_stats().graphs_autograd++;
      std::vector<int32_t> updated = joint->updated_inputs();
      if (updated.empty()) return joint;
      return runtime::make_alias_checked_graph(std::move(joint), runtime::make_eager_interpreter(g, constants_of(*g)),
                                               std::move(updated));
    } catch (const std::exception& e) {
      reason = std::string("autodiff: ") + e.what();
    }
  } else {
    reason = unsupported_reason(*g);
    if (!reason.empty())
      if (auto updating = compile_with_buffer_updates(g, constants_of, options, training_half)) return updating;
  }
  // 4. Lower, or find the artefact in the graph cache; runtime/ loads and runs it.
  if (reason.empty()) {
    try {
      auto compiled = compile_artifact(g, constants_of, options, training_half, folded, escaping);
      runtime::kiln_backend_stats().graphs_compiled++;
      return compiled;
    } catch (const std::exception& e) {
      reason = e.what();
    }
  }
  KILN_LOG(fallbacks) << "kiln backend: running the graph on the eager interpreter: " << reason;
  runtime::KilnBackendStats& stats = runtime::kiln_backend_stats();
  stats.graphs_fallback++;
  stats.fallbacks_since_reset++;
  stats.last_fallback_reason = stats.fallback_reason_since_reset = reason;
  if (needs_autograd(*g)) g = with_cudnn_batch_norm(std::move(g));
  std::vector<at::Tensor> constants = constants_of(*g);
  auto fallback = runtime::make_fallback_graph(std::move(g), std::move(constants), reason, std::move(folded));
  if (!options.cuda_graph_pool) return fallback;
  return runtime::make_cuda_graph_runner(std::move(fallback), options.cuda_graph_pool, escaping, "graph",
                                         "it runs on the eager interpreter (" + reason + ")");
}

void set_compiled_autograd(bool on) { g_compiled_autograd = on; }
bool compiled_autograd() { return g_compiled_autograd; }
void set_cuda_ptx_check(bool on) { g_cuda_ptx_check = on; }
CudaPtxCheck& cuda_ptx_check() { return ptx_check_state(); }

}  // namespace kiln::compile
