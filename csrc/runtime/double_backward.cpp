// Double backward by replay (double_backward.h).
#include "runtime/double_backward.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "common/error.h"
#include "common/log.h"
#include "runtime/eager_interpreter.h"

namespace kiln::runtime {

namespace {

// Whether `node` draws from a random generator: its op is tagged nondeterministic_seeded (dropout, bernoulli, rand*),
// unless a dropout probability of 0 makes it draw nothing that matters.
bool draws_random_numbers(const graph::Node& node) {
  const std::string overload = node.overload == "default" ? "" : node.overload;
  auto handle = c10::Dispatcher::singleton().findSchema({node.op, overload});
  if (!handle || !handle->hasTag(at::Tag::nondeterministic_seeded)) return false;
  for (size_t i = 0; i < node.args.size() && i < node.arg_names.size(); ++i)
    if (node.arg_names[i] == "p")
      if (const double* p = std::get_if<double>(&node.args[i]); p && *p == 0.0) return false;
  return true;
}

std::string refusal_of(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes) {
    if (draws_random_numbers(node))
      return "the graph draws random numbers (" + node.qualified_name() + "), which a replay would draw anew";
    if (!node.mutates_args) continue;
    for (const graph::ArgValue& arg : node.args) {
      bool writes_input = false;
      graph::for_each_tensor(arg, [&](graph::ValueId id) { writes_input = writes_input || g.values[id].is_input; });
      if (writes_input)
        return "the graph updates its inputs in place (" + node.qualified_name() +
               "), which a replay would read updated and update again";
    }
  }
  return "";
}

}  // namespace

DoubleBackwardReplay::DoubleBackwardReplay(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants)
    : graph_(std::move(g)), constants_(std::move(constants)), refusal_(refusal_of(*graph_)) {}

std::vector<at::Tensor> DoubleBackwardReplay::gradients(const std::vector<at::Tensor>& inputs,
                                                        const std::vector<int64_t>& versions,
                                                        const std::vector<at::Tensor>& grad_outputs,
                                                        const std::vector<size_t>& computed,
                                                        const std::vector<int32_t>& grad_inputs) {
  KILN_ASSERT(refusal_.empty()) << refusal_;
  KILN_ASSERT_EQ(inputs.size(), versions.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    KILN_CHECK(!inputs[i].defined() || inputs[i]._version() == versions[i])
        << "one of the variables needed for gradient computation has been modified by an inplace operation: input "
        << i << " of a kiln-compiled graph is at version " << inputs[i]._version() << "; expected version "
        << versions[i] << " instead (a backward with create_graph=True replays the graph on its inputs)";
  at::AutoGradMode grad(true);
  const std::vector<at::Tensor> replayed = record_forward(inputs);
  if (!used_.exchange(true, std::memory_order_relaxed))
    KILN_LOG(perf) << "kiln autograd: a backward with create_graph=True replayed a compiled graph; its later forwards "
                      "that need grad record eager's autograd history op by op instead of running the compiled halves";
  std::vector<at::Tensor> outputs, seeds;
  for (size_t i = 0; i < computed.size() && i < grad_outputs.size(); ++i) {
    const at::Tensor& out = replayed.at(computed[i]);
    if (grad_outputs[i].defined() && out.defined() && out.requires_grad()) {
      outputs.push_back(out);
      seeds.push_back(grad_outputs[i]);
    }
  }
  std::vector<at::Tensor> wrt;
  std::vector<size_t> position;  // grad_inputs index of each entry of wrt
  for (size_t i = 0; i < grad_inputs.size(); ++i) {
    const at::Tensor& input = inputs.at(grad_inputs[i]);
    if (input.defined() && input.requires_grad()) {
      wrt.push_back(input);
      position.push_back(i);
    }
  }
  std::vector<at::Tensor> result(inputs.size());
  if (outputs.empty() || wrt.empty()) return result;
  const std::vector<at::Tensor> grads = torch::autograd::grad(outputs, wrt, seeds, /*retain_graph=*/true,
                                                              /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t k = 0; k < grads.size(); ++k) result[grad_inputs[position[k]]] = grads[k];
  return result;
}

std::vector<at::Tensor> DoubleBackwardReplay::record_forward(const std::vector<at::Tensor>& inputs) {
  std::call_once(prepared_, [this] { interpreter_ = make_eager_interpreter(graph_, constants_); });
  return interpreter_->run(inputs);
}

}  // namespace kiln::runtime
