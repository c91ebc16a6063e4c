// The autodiff split (split_for_autodiff.h): the joint graphs built or read back, the plain-data signature the
// autograd node runs by, and both halves compiled.
#include "compile/split_for_autodiff.h"

#include <optional>
#include <string>
#include <vector>

#include <c10/core/GradMode.h>

#include "autodiff/build_joint_graphs.h"
#include "cache/graph_cache.h"
#include "cache/joint_cache.h"
#include "cache/kernel_cache.h"
#include "common/error.h"
#include "common/log.h"
#include "common/progress.h"
#include "compile/meta_oracle.h"
#include "passes/drop_absent_gradients.h"
#include "runtime/eager_interpreter.h"
#include "runtime/kernel_graph.h"
#include "runtime/torch_info.h"

namespace kiln::compile {

namespace {

// Which gradients of the backward graph depend on which incoming output gradients (its first inputs), by walking its
// nodes in order. An input whose gradient depends only on outputs that got none (an unused output, as BERT's pooler
// output under a loss of the hidden states) gets none either, as eager's engine never reaches it: a zero gradient
// instead would give AdamW a parameter to decay that eager leaves alone.
std::vector<std::vector<bool>> gradient_reach(const graph::Graph& backward, size_t incoming) {
  std::vector<std::vector<bool>> reach(backward.values.size());
  for (size_t j = 0; j < incoming; ++j) {
    reach[backward.inputs.at(j)].assign(incoming, false);
    reach[backward.inputs[j]][j] = true;
  }
  for (const graph::Node& node : backward.nodes) {
    std::vector<bool> from(incoming, false);
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](graph::ValueId id) {
        for (size_t j = 0; j < reach[id].size(); ++j) from[j] = from[j] || reach[id][j];
      });
    for (graph::ValueId out : node.outputs) reach[out] = from;
  }
  std::vector<std::vector<bool>> result;
  for (graph::ValueId out : backward.outputs) {
    std::vector<bool> r = reach[out];
    r.resize(incoming, false);
    result.push_back(std::move(r));
  }
  return result;
}

// What the autograd node needs of `joint`: everything but the graphs themselves, which compile/ lowers.
runtime::AutogradSignature signature_of(const autodiff::JointGraphs& joint) {
  runtime::AutogradSignature signature;
  signature.num_inputs = joint.forward->inputs.size();
  signature.num_outputs = joint.num_outputs;
  signature.output_inputs = joint.output_inputs;
  signature.output_differentiable = joint.output_differentiable;
  signature.updated_inputs = joint.updated_inputs;
  signature.saved_from_input = joint.saved_from_input;
  signature.grad_inputs = joint.grad_inputs;
  const graph::Graph& backward = *joint.backward;
  for (graph::ValueId id : backward.inputs) signature.backward_inputs.push_back(backward.values[id].meta);
  for (graph::ValueId id : backward.outputs) signature.backward_outputs.push_back(backward.values[id].meta);
  size_t incoming = 0;
  for (bool differentiable : joint.output_differentiable) incoming += differentiable;
  signature.reaches = gradient_reach(backward, incoming);
  KILN_ASSERT_EQ(signature.reaches.size(), joint.grad_inputs.size()) << "backward outputs";
  return signature;
}

}  // namespace

std::shared_ptr<runtime::AutogradGraph> split_for_autodiff(std::shared_ptr<const graph::Graph> g,
                                                           CompileHalf compile_half,
                                                           std::shared_ptr<runtime::DoubleBackwardReplay> replay) {
  progress::stage("autodiff");
  const passes::CudnnBatchNorm cudnn = cudnn_batch_norm_here();
  // No key (no SHA-256 available, cache/kernel_cache.h): nothing is read or stored.
  const std::optional<std::string> key =
      cache::graph_key(*g, "joint graphs, torch " + runtime::built_torch_version() + ", cudnn batch norm " +
                               std::to_string(cudnn.available) + " " + std::to_string(cudnn.min_epsilon));
  autodiff::JointGraphs joint;
  if (std::optional<autodiff::JointGraphs> cached = key ? cache::load_joint_graphs(*key, *g) : std::nullopt) {
    joint = std::move(*cached);
    cache::stats().joint_hits++;
    KILN_LOG(perf) << "kiln autograd: forward and backward graphs found in the graph cache";
  } else {
    std::unique_ptr<graph::OpOracle> oracle = make_meta_oracle();
    at::NoGradGuard no_grad;
    joint = autodiff::build_joint_graphs(*g, *oracle, cudnn);
    if (key) cache::store_joint_graphs(*key, joint, *g);
  }
  KILN_LOG(graph) << "kiln autograd partition: saves " << joint.saved_tensors << " tensors (" << joint.saved_bytes
                  << " bytes), recomputes " << joint.recomputed_nodes << " nodes; was "
                  << joint.saved_bytes_before_partition << " bytes";
  KILN_LOG(graph) << "kiln autograd: forward\n" << joint.forward->to_string() << "backward\n" << joint.backward->to_string();
  runtime::AutogradSignature signature = signature_of(joint);
  std::vector<std::shared_ptr<runtime::CompiledGraph>> view_replays;
  for (const auto& view : joint.output_views)
    view_replays.push_back(view ? runtime::make_eager_interpreter(view, {}) : nullptr);
  const log::Stopwatch forward_started;
  std::shared_ptr<runtime::CompiledGraph> forward;
  {
    const progress::Part part("forward half");
    forward = compile_half(joint.forward, signature.num_outputs);
  }
  const double forward_ms = forward_started.ms();
  const log::Stopwatch backward_started;
  std::shared_ptr<runtime::CompiledGraph> backward;
  {
    const progress::Part part("backward half");
    backward = compile_half(joint.backward, SIZE_MAX);
  }
  KILN_LOG(perf) << "kiln autograd: forward compiled in " << log::whole_ms(forward_ms) << " ms, backward in "
                 << log::whole_ms(backward_started.ms()) << " ms";
  runtime::kiln_backend_stats().autograd_saved_bytes += joint.saved_bytes;
  runtime::kiln_backend_stats().autograd_recomputed_nodes += joint.recomputed_nodes;
  // The backward again for calls where some outputs get no gradient (runtime/autograd_graph.h), from the same joint
  // backward graph, when a backward first meets such a call.
  std::shared_ptr<const graph::Graph> joint_backward = joint.backward;
  runtime::CompileBackwardWithout compile_without =
      [joint_backward, compile_half](const std::vector<bool>& absent) -> std::shared_ptr<runtime::CompiledGraph> {
    int dropped = 0;
    std::shared_ptr<graph::Graph> without = passes::drop_absent_gradients(*joint_backward, absent, &dropped);
    if (!without) return nullptr;
    std::string which;
    for (size_t j = 0; j < absent.size(); ++j)
      if (absent[j]) which += (which.empty() ? "" : ", ") + std::to_string(j);
    const log::Stopwatch started;
    std::shared_ptr<runtime::CompiledGraph> compiled;
    {
      const progress::Part part("backward half without unused gradients");
      compiled = compile_half(std::move(without), SIZE_MAX);
    }
    runtime::kiln_backend_stats().autograd_backward_variants++;
    KILN_LOG(perf) << "kiln autograd: backward compiled again without the gradients of differentiable outputs " << which
                   << " (none came; " << dropped << " sums with them dropped) in " << log::whole_ms(started.ms()) << " ms";
    return compiled;
  };
  return runtime::make_autograd_graph(std::move(signature), std::move(forward), std::move(backward),
                                      std::move(view_replays), std::move(compile_without), std::move(replay));
}

}  // namespace kiln::compile
