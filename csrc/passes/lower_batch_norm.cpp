// Inference batch norm as pointwise ATen ops (passes/lower_batch_norm.h).
//
// Design: y = (x - mean) * rsqrt(var + eps) * weight + bias, with the per-channel vectors viewed as
// [C, 1, ..., 1] so that ordinary broadcasting lines them up with dim 1. The new nodes are plain ATen ops
// (view, sub, add, rsqrt, mul) that the decomposition table already knows, so fusion folds them into
// one kernel with whatever follows (the ReLU, the residual add). The last node defines the batch norm's own
// output value, so its consumers are untouched. Only float32 calls whose statistics outputs nobody reads, and
// 16-bit inputs with float32 statistics (autocast's batch norm): ATen computes those in float32 and rounds the
// result once, which the lowering does too (float32 nodes, then one cast into the output value).
#include "passes/lower_batch_norm.h"

#include <optional>

#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::TensorArg;
using graph::ValueId;

namespace {

struct BatchNormArgs {
  ValueId input, mean, var;
  std::optional<ValueId> weight, bias;
  double eps;
};

// The arguments of an inference batch norm that qualifies, or nullopt.
std::optional<BatchNormArgs> inference_batch_norm(const Graph& g, const Node& n) {
  const std::string name = n.qualified_name();
  size_t eps_index;
  // cudnn_batch_norm: what a half-precision CUDA input under autocast records (ATen picks cuDNN for it), with the
  // same arguments; its fourth result is cuDNN's reserve.
  if (name == "aten::native_batch_norm.default" || name == "aten::cudnn_batch_norm.default") {
    const bool* training = n.args.size() > 5 ? std::get_if<bool>(&n.args[5]) : nullptr;
    if (!training || *training) return std::nullopt;
    eps_index = 7;
  } else if (name == "aten::_native_batch_norm_legit_no_training.default") {
    eps_index = 6;
  } else {
    return std::nullopt;
  }
  BatchNormArgs a;
  auto input = tensor_at(n, 0), mean = tensor_at(n, 3), var = tensor_at(n, 4);
  auto eps = number_at(n, eps_index);
  if (!input || !mean || !var || !eps || n.outputs.size() < 3) return std::nullopt;
  for (size_t r = 3; r < n.outputs.size(); ++r)
    if (graph::is_read(g, n.outputs[r])) return std::nullopt;
  a.input = *input, a.mean = *mean, a.var = *var, a.eps = *eps;
  a.weight = tensor_at(n, 1), a.bias = tensor_at(n, 2);
  const auto& x = g.values[a.input].meta;
  using graph::ScalarType;
  const bool half = x.dtype == ScalarType::Half || x.dtype == ScalarType::BFloat16;
  if (x.sizes.size() < 2 || (x.dtype != ScalarType::Float && !half)) return std::nullopt;
  for (auto v : {std::optional<ValueId>(a.mean), std::optional<ValueId>(a.var), a.weight, a.bias}) {
    if (!v) continue;
    const auto& m = g.values[*v].meta;
    if (m.dtype != graph::ScalarType::Float || m.sizes != std::vector<int64_t>{x.sizes[1]} || !(m.device == x.device))
      return std::nullopt;
  }
  if (graph::is_read(g, n.outputs[1]) || graph::is_read(g, n.outputs[2])) return std::nullopt;
  return a;
}

class Lowering {
 public:
  explicit Lowering(Graph& g) : rewriter_(g) {}

  // `plan[i]`: the arguments of node i when it is lowered (found on the graph before any change).
  bool run(const std::vector<std::optional<BatchNormArgs>>& plan) {
    return rewriter_.replace_planned(plan,
                                     [&](const BatchNormArgs& a, const Node& node) { lower(a, node.outputs[0]); });
  }

 private:
  void lower(const BatchNormArgs& a, ValueId result) {
    Graph& g = rewriter_.graph();
    const graph::TensorMeta out = g.values[result].meta;
    std::vector<int64_t> channel_shape(out.sizes.size() - 1, 1);
    channel_shape[0] = out.sizes[1];
    // A per-channel vector as a [C, 1, ...] view expanded (stride 0) to the output's shape: every node then
    // has the output's index space, so fusion puts the whole normalisation in the consumer's kernel.
    auto per_channel = [&](ValueId v) {
      graph::TensorMeta m = g.values[v].meta;
      m.sizes = channel_shape;
      m.strides = graph::contiguous_strides(channel_shape);
      m.storage_offset = 0;
      m.requires_grad = false;
      const ValueId viewed =
          rewriter_.add("aten::view", "default", {TensorArg{v}, channel_shape}, {"self", "size"}, 2, m, true);
      return rewriter_.expand(viewed, out.sizes);
    };
    graph::TensorMeta full = out;  // every new node has the output's index space (see per_channel)
    full.requires_grad = false;
    full.storage_offset = 0;
    full.dtype = graph::ScalarType::Float;  // a 16-bit input is normalised in float32 and cast once, as ATen does
    const bool cast = out.dtype != full.dtype;
    const ValueId last = cast ? -1 : result;
    const ValueId mean = per_channel(a.mean);
    const ValueId var = per_channel(a.var);
    const ValueId centred = rewriter_.add("aten::sub", "Tensor", {TensorArg{a.input}, TensorArg{mean}, int64_t{1}},
                                          {"self", "other", "alpha"}, 2, full);
    const ValueId shifted =
        rewriter_.add("aten::add", "Tensor", {TensorArg{var}, a.eps, int64_t{1}}, {"self", "other", "alpha"}, 2, full);
    const ValueId rstd = rewriter_.add("aten::rsqrt", "default", {TensorArg{shifted}}, {"self"}, 1, full);
    const bool last_is_scale = !a.weight && !a.bias;
    ValueId y = rewriter_.add("aten::mul", "Tensor", {TensorArg{centred}, TensorArg{rstd}}, {"self", "other"}, 2, full,
                              false, last_is_scale ? last : -1);
    if (a.weight)
      y = rewriter_.add("aten::mul", "Tensor", {TensorArg{y}, TensorArg{per_channel(*a.weight)}}, {"self", "other"}, 2,
                        full, false, a.bias ? -1 : last);
    if (a.bias)
      y = rewriter_.add("aten::add", "Tensor", {TensorArg{y}, TensorArg{per_channel(*a.bias)}, int64_t{1}},
                        {"self", "other", "alpha"}, 2, full, false, last);
    if (cast) rewriter_.cast(y, out.dtype, result);
  }

  GraphRewriter rewriter_;
};

}  // namespace

bool lower_inference_batch_norm(Graph& g) {
  std::vector<std::optional<BatchNormArgs>> plan;
  bool any = false;
  for (const Node& node : g.nodes) {
    plan.push_back(inference_batch_norm(g, node));
    any = any || plan.back().has_value();
  }
  return any && Lowering(g).run(plan);
}

}  // namespace kiln::passes
