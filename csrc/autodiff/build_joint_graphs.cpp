// The joint builder: reverse walk over the captured graph, one derivative rule per node.
//
// Design: gradients live in a map from forward value to backward value; a node runs its rule only when
// one of its results has a gradient, and a rule's contributions are reduced/cast to the argument's meta
// and summed into the map. Forward values the backward reads are resolved by BackwardBuilder (saved, or
// recomputed when they are views); after the walk, the min-cut partitioner (partition.h) decides which
// of them the forward saves and which the backward recomputes from cheaper saved values.
#include "autodiff/build_joint_graphs.h"

#include <algorithm>
#include <map>
#include <set>

#include "autodiff/derivative_rules.h"
#include "autodiff/partition.h"
#include "common/error.h"
#include "common/log.h"
#include "graph/op_facts.h"
#include "passes/channels_last.h"
#include "passes/functionalize_buffer_updates.h"
#include "passes/lower_attention.h"
#include "passes/lower_cross_entropy.h"
#include "passes/use_cudnn_batch_norm.h"

namespace kiln::autodiff {

namespace {

bool differentiable(const graph::Value& v) { return v.meta.requires_grad && graph::is_floating_or_complex(v.meta.dtype); }

// Captured graphs whose outputs alias inputs (views or the inputs themselves) keep eager's view
// semantics only under the eager interpreter; an in-place op other than BatchNorm's statistics update
// could write a value the backward reads (buffer updates of inputs were made functional before this).
void check_supported(const graph::Graph& g) {
  std::set<graph::ValueId> seen;
  for (graph::ValueId id : g.outputs) {
    const graph::Value& v = g.value(id);
    if (v.is_input || v.is_constant) KILN_UNSUPPORTED() << "a graph output is a graph constant";
    if (v.producer >= 0 && g.nodes[v.producer].is_view)
      KILN_UNSUPPORTED() << "a graph output is a view (" << g.nodes[v.producer].qualified_name() << ")";
    if (!seen.insert(id).second) KILN_UNSUPPORTED() << "a value is returned twice";
  }
  for (const graph::Node& node : g.nodes) {
    if (!node.mutates_args) continue;
    const std::string name = node.qualified_name();
    if (!graph::op_facts(name).mutates_only_buffers) KILN_UNSUPPORTED() << "in-place op " << name;
  }
}

// The view nodes that make `id` from a graph input, first first, each with the index of the result the chain goes on
// from (split and unbind return several), and that input's index; nullopt when `id` is not made so (a view op with
// another tensor argument does not count).
using ViewChain = std::vector<std::pair<const graph::Node*, size_t>>;
std::optional<std::pair<ViewChain, int32_t>> view_chain_from_input(const graph::Graph& g, graph::ValueId id) {
  ViewChain chain;
  for (int steps = 0; steps < 1000; ++steps) {
    const graph::Value& v = g.value(id);
    if (v.is_input) {
      std::reverse(chain.begin(), chain.end());
      return std::make_pair(std::move(chain), v.input_index);
    }
    if (v.producer < 0) return std::nullopt;
    const graph::Node& node = g.nodes[v.producer];
    const auto* base = node.args.empty() ? nullptr : std::get_if<graph::TensorArg>(&node.args[0]);
    if (!node.is_view || !base) return std::nullopt;
    bool other_tensors = false;
    for (size_t a = 1; a < node.args.size(); ++a) graph::for_each_tensor(node.args[a], [&](graph::ValueId) { other_tensors = true; });
    if (other_tensors) return std::nullopt;
    const size_t result = static_cast<size_t>(std::find(node.outputs.begin(), node.outputs.end(), id) - node.outputs.begin());
    chain.emplace_back(&node, result);
    id = base->id;
  }
  return std::nullopt;
}

// A graph of one input (shaped as `input`) and copies of `chain`'s view nodes applied to it in turn.
std::shared_ptr<graph::Graph> replay_graph(const graph::Graph& g, const ViewChain& chain, graph::ValueId input) {
  auto replay = std::make_shared<graph::Graph>();
  graph::ValueId current = replay->add_input(g.value(input).meta);
  for (const auto& [node, result] : chain) {
    graph::Node copy = *node;
    copy.args[0] = graph::TensorArg{current};
    copy.outputs.clear();
    std::vector<graph::TensorMeta> metas;
    for (graph::ValueId out : node->outputs) metas.push_back(g.value(out).meta);
    current = replay->add_node(std::move(copy), std::move(metas)).at(result);
  }
  replay->set_outputs({current});
  replay->verify();
  return replay;
}

// Outputs that are graph inputs (`return y, x`; `x.contiguous()` of a contiguous x) or views of one (`x.t()`,
// `x[0]`) leave the graph's outputs: the runtime returns the caller's own tensor, or replays the views on it,
// which is what eager returns (the same object, or a view of it with its own autograd history), and the joint
// program computes the rest. Fills JointGraphs::output_inputs and output_views.
void pass_inputs_through(graph::Graph& g, JointGraphs& joint) {
  std::vector<graph::ValueId> computed;
  for (graph::ValueId id : g.outputs) {
    auto chain = view_chain_from_input(g, id);
    joint.output_inputs.push_back(chain ? chain->second : -1);
    joint.output_views.push_back(chain && !chain->first.empty() ? replay_graph(g, chain->first, g.inputs.at(chain->second)) : nullptr);
    if (!chain) computed.push_back(id);
  }
  if (computed.size() == g.outputs.size()) {
    joint.output_inputs.clear();
    joint.output_views.clear();
    return;
  }
  if (computed.empty()) KILN_UNSUPPORTED() << "every graph output is a graph input or a view of one";
  g.set_outputs(computed);
}

// The value a chain of views starts from (itself when it is not a view).
graph::ValueId view_root(const graph::Graph& g, graph::ValueId id) {
  for (int steps = 0; steps < 1000; ++steps) {
    const graph::Value& v = g.value(id);
    if (v.producer < 0 || !g.nodes[v.producer].is_view) return id;
    const graph::Node& view = g.nodes[v.producer];
    const auto* base = view.args.empty() ? nullptr : std::get_if<graph::TensorArg>(&view.args[0]);
    if (!base) return id;
    id = base->id;
  }
  return id;
}

// Outputs that are views of an intermediate (`logits.view(-1, n)`, `x.squeeze(1)`, `h.transpose(0, 1)` as the
// last step) are returned as copies: a compiled autograd node's outputs are its own tensors. Eager's view could
// only be told apart through its base, so this is done when nothing else returned shares that base; a view
// of an input, or of a value returned too, keeps the eager interpreter (check_supported).
void materialize_view_outputs(graph::Graph& g, graph::OpOracle& oracle) {
  std::map<graph::ValueId, int> roots;  // root -> how many outputs reach it
  for (graph::ValueId id : g.outputs) roots[view_root(g, id)]++;
  std::vector<graph::ValueId> outputs = g.outputs;
  bool changed = false;
  for (graph::ValueId& id : outputs) {
    const graph::Value& v = g.value(id);
    if (v.producer < 0 || !g.nodes[v.producer].is_view) continue;
    const graph::ValueId root = view_root(g, id);
    const graph::Value& base = g.value(root);
    if (base.is_input || base.is_constant || roots[root] > 1) continue;
    graph::Node clone;
    clone.op = "aten::clone";
    clone.overload = "default";
    clone.args = {graph::TensorArg{id}, graph::NoneArg{}};
    std::vector<graph::TensorMeta> metas = oracle.complete_node(g, clone);
    metas.at(0).requires_grad = v.meta.requires_grad;
    id = g.add_node(std::move(clone), std::move(metas)).at(0);
    changed = true;
  }
  if (changed) g.set_outputs(outputs);
}

// Gradient inputs are dense and contiguous: the runtime makes incoming gradients so before the call.
graph::TensorMeta gradient_meta(const graph::TensorMeta& output) {
  graph::TensorMeta meta = output;
  meta.strides = graph::contiguous_strides(meta.sizes);
  meta.storage_offset = 0;
  meta.requires_grad = false;
  return meta;
}

// The sum of a value's gradient contributions. Where the value was split by `select` along one dimension and
// every index got a gradient (nn.MultiheadAttention's packed q/k/v projection: proj[0], proj[1], proj[2]),
// the select_backward pieces (each a zero-filled tensor of the whole value with one slice written) become one
// stack of their gradients: one pass writing the value instead of three fills, three copies and two adds.
// The dims of `meta` from outermost to innermost in memory, when its strides lay it out densely (a permutation
// of a contiguous tensor); empty otherwise.
std::vector<int64_t> dense_dim_order(const graph::TensorMeta& meta) {
  const auto rank = static_cast<int64_t>(meta.sizes.size());
  std::vector<int64_t> order(rank);
  for (int64_t d = 0; d < rank; ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return meta.strides[x] > meta.strides[y]; });
  int64_t expected = 1;
  for (int64_t i = rank - 1; i >= 0; --i) {
    const int64_t d = order[i];
    if (meta.sizes[d] != 1 && meta.strides[d] != expected) return {};
    expected *= meta.sizes[d];
  }
  return order;
}

// stack(pieces, dim) for `value`'s gradient. When the forward made `value` as a contiguous copy of a permuted
// view (nn.MultiheadAttention's packed projection: linear(x).unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
// .squeeze(-2).contiguous()), the stack is written in that view's memory order and permuted to the value's
// shape: the gradient then flows back through the view chain as views, and the projection's gradient needs no
// copy of its own.
graph::ValueId stack_pieces(BackwardBuilder& b, const graph::Graph& forward, graph::ValueId value,
                            const graph::TensorListArg& pieces, int64_t dim) {
  const graph::Value& v = forward.value(value);
  const graph::Node* clone = v.producer >= 0 ? &forward.nodes[v.producer] : nullptr;
  std::vector<int64_t> order;
  if (clone && clone->qualified_name() == "aten::clone.default") {
    const graph::TensorMeta* source = graph::tensor_meta(forward, clone->args.at(0));
    if (source && source->sizes == v.meta.sizes) order = dense_dim_order(*source);
  }
  if (order.empty() || std::is_sorted(order.begin(), order.end())) {
    if (std::optional<graph::ValueId> through = b.stack_through_reshapes(pieces, dim)) return *through;
    return b.emit("aten::stack", "default", {pieces, dim});
  }
  return b.stack_in_order(pieces, dim, order);
}

graph::ValueId sum_of_contributions(BackwardBuilder& b, const graph::Graph& backward, const graph::Graph& forward,
                                    graph::ValueId value, const std::vector<graph::ValueId>& contributions) {
  struct Piece {
    int64_t index;
    graph::ValueId grad;
    graph::ValueId contribution;
  };
  std::map<std::pair<int64_t, std::vector<int64_t>>, std::vector<Piece>> by_dim;  // (dim, sizes) -> pieces
  std::vector<graph::ValueId> terms;
  for (graph::ValueId c : contributions) {
    const graph::Value& v = backward.value(c);
    const graph::Node* node = v.producer >= 0 ? &backward.nodes[v.producer] : nullptr;
    // select_backward(grad, input_sizes, dim, index)
    if (node && node->qualified_name() == "aten::select_backward.default" && node->args.size() == 4) {
      const auto* grad = std::get_if<graph::TensorArg>(&node->args[0]);
      const auto* sizes = std::get_if<std::vector<int64_t>>(&node->args[1]);
      const auto* dim = std::get_if<int64_t>(&node->args[2]);
      const auto* index = std::get_if<int64_t>(&node->args[3]);
      if (grad && sizes && dim && index && !sizes->empty()) {
        const auto rank = static_cast<int64_t>(sizes->size());
        const int64_t d = *dim < 0 ? *dim + rank : *dim;
        const int64_t i = *index < 0 ? *index + (*sizes)[d] : *index;
        by_dim[{d, *sizes}].push_back({i, grad->id, c});
        continue;
      }
    }
    terms.push_back(c);
  }
  for (auto& [key, pieces] : by_dim) {
    const auto& [dim, sizes] = key;
    std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) { return x.index < y.index; });
    bool covers = static_cast<int64_t>(pieces.size()) == sizes[dim];
    for (size_t k = 0; covers && k < pieces.size(); ++k)
      covers = pieces[k].index == static_cast<int64_t>(k) &&
               backward.value(pieces[k].grad).meta.dtype == backward.value(pieces[0].contribution).meta.dtype;
    if (!covers) {
      for (const Piece& p : pieces) terms.push_back(p.contribution);
      continue;
    }
    graph::TensorListArg items;
    for (const Piece& p : pieces) items.ids.push_back(p.grad);
    terms.push_back(stack_pieces(b, forward, value, items, dim));
  }
  graph::ValueId sum = terms.front();
  for (size_t k = 1; k < terms.size(); ++k) sum = b.add(sum, terms[k]);
  return sum;
}

}  // namespace

JointGraphs build_joint_graphs(const graph::Graph& graph_with_updates, graph::OpOracle& oracle,
                              const passes::CudnnBatchNorm& cudnn) {
  const log::Stopwatch started;
  // Buffer updates (num_batches_tracked.add_(1)) become functional; the runtime writes them back.
  graph::Graph captured = graph_with_updates;
  const std::vector<passes::BufferUpdate> updates = passes::functionalize_buffer_updates(captured);
  passes::lower_attention_for_autodiff(captured, oracle);  // attention kernels that save what their backward reads
  passes::lower_cross_entropy(captured, oracle);  // a loss over logsumexp: the forward saves no N x C log_softmax
  materialize_view_outputs(captured, oracle);
  // CUDA convolution chains go channels-last before the split, so the forward saves its activations in the
  // layout it computes them in and the backward is built over the same layout (relaid after the split, the
  // forward would copy every saved activation back to the recorded layout). Then batch norm takes cuDNN's
  // kernel, as eager's does. CPU convolutions keep their layout in training (passes/channels_last.h says why).
  passes::relayout_convolutions_channels_last(captured, /*cpu=*/false);
  passes::use_cudnn_batch_norm(captured, oracle, cudnn);
  JointGraphs joint;
  pass_inputs_through(captured, joint);
  check_supported(captured);
  joint.backward = std::make_shared<graph::Graph>();
  BackwardBuilder b(captured, *joint.backward, oracle);

  // Gradients reaching each forward value, in the backward graph: the contributions are kept apart until the
  // gradient is read, then summed (select pieces that cover a dimension become one stack: sum_of_contributions).
  std::map<graph::ValueId, std::vector<graph::ValueId>> grads;
  auto accumulate = [&](graph::ValueId forward_id, graph::ValueId grad) { grads[forward_id].push_back(grad); };
  auto gradient = [&](graph::ValueId forward_id) -> std::optional<graph::ValueId> {
    auto it = grads.find(forward_id);
    if (it == grads.end()) return std::nullopt;
    if (it->second.size() > 1) it->second = {sum_of_contributions(b, *joint.backward, captured, forward_id, it->second)};
    return it->second.front();
  };

  joint.num_outputs = captured.outputs.size();
  for (graph::ValueId id : captured.outputs) {
    const graph::Value& v = captured.value(id);
    joint.output_differentiable.push_back(differentiable(v));
    if (differentiable(v)) accumulate(id, joint.backward->add_input(gradient_meta(v.meta)));
  }
  const size_t num_gradients = joint.backward->inputs.size();

  for (size_t n = captured.nodes.size(); n-- > 0;) {
    const graph::Node& node = captured.nodes[n];
    std::vector<std::optional<graph::ValueId>> grad_outputs;
    bool any = false;
    for (graph::ValueId out : node.outputs) {
      grad_outputs.push_back(gradient(out));
      any = any || grad_outputs.back().has_value();
    }
    if (!any || is_non_differentiable_op(node.qualified_name())) continue;
    const DerivativeRule* rule = find_derivative_rule(node.qualified_name());
    if (!rule) KILN_UNSUPPORTED() << "no derivative rule for " << node.qualified_name();
    for (size_t i = rule->all_results ? grad_outputs.size() : rule->differentiable_results; i < grad_outputs.size(); ++i)
      if (grad_outputs[i]) KILN_UNSUPPORTED() << "a gradient reaches result " << i << " of " << node.qualified_name();
    if (!grad_outputs[0] && !rule->all_results) continue;
    RuleCall call(b, captured, node, std::move(grad_outputs));
    rule->emit(call);
    for (const auto& [arg_index, grad] : call.grads()) {
      const graph::ValueId forward_id = std::get<graph::TensorArg>(node.args.at(arg_index)).id;
      if (!differentiable(captured.value(forward_id))) continue;
      accumulate(forward_id, b.grad_for(grad, forward_id));
    }
    for (const auto& [slot, grad] : call.item_grads()) {
      const graph::ValueId forward_id = *std::get<graph::TensorListArg>(node.args.at(slot.first)).ids.at(slot.second);
      if (!differentiable(captured.value(forward_id))) continue;
      accumulate(forward_id, b.grad_for(grad, forward_id));
    }
  }

  // Backward outputs: the gradients of the captured inputs that require grad and received one.
  std::vector<graph::ValueId> backward_outputs;
  for (graph::ValueId id : captured.inputs) {
    const graph::Value& v = captured.value(id);
    const std::optional<graph::ValueId> grad = differentiable(v) ? gradient(id) : std::nullopt;
    if (!grad) continue;
    joint.grad_inputs.push_back(v.input_index);
    backward_outputs.push_back(*grad);
  }
  joint.backward->set_outputs(backward_outputs);

  const double rules_ms = started.ms();
  // What the forward saves: the rules' reads, or cheaper values the backward recomputes them from.
  const Partition partition = partition_saved_values(captured, b.saved_forward_values(), num_gradients, *joint.backward);
  joint.saved_bytes = partition.saved_bytes;
  joint.saved_tensors = partition.saved_tensors;
  joint.saved_bytes_before_partition = partition.saved_bytes_before;
  joint.recomputed_nodes = partition.recomputed_nodes;
  for (graph::ValueId saved : partition.saved) {
    const graph::Value& v = captured.value(saved);
    for (const passes::BufferUpdate& update : updates)
      if (v.is_input && v.input_index == update.input_index)
        KILN_UNSUPPORTED() << "the backward reads input " << v.input_index << ", which the graph updates in place";
  }

  // The forward: the captured graph run with grad off, returning the saved intermediates too.
  joint.forward = std::make_shared<graph::Graph>(captured);
  for (graph::Value& v : joint.forward->values) v.meta.requires_grad = false;
  std::vector<graph::ValueId> forward_outputs = captured.outputs;
  for (const passes::BufferUpdate& update : updates) {
    joint.updated_inputs.push_back(update.input_index);
    forward_outputs.push_back(update.final_value);
  }
  for (graph::ValueId saved : partition.saved) {
    const graph::Value& v = captured.value(saved);
    joint.saved_from_input.push_back(v.is_input ? v.input_index : -1);
    if (!v.is_input) forward_outputs.push_back(saved);
  }
  joint.forward->set_outputs(forward_outputs);
  joint.forward->verify();
  joint.backward->verify();
  KILN_LOG(perf) << "kiln autograd: forward and backward graphs built in " << log::whole_ms(started.ms())
                 << " ms (derivative rules " << log::whole_ms(rules_ms) << " ms, " << captured.nodes.size()
                 << " forward nodes, " << joint.backward->nodes.size() << " backward nodes)";
  return joint;
}

}  // namespace kiln::autodiff
