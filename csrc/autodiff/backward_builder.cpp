// BackwardBuilder: forward values in the backward graph, emission with oracle metas, shared helpers.
#include "autodiff/backward_builder.h"

#include <algorithm>

#include "common/error.h"
#include "graph/op_facts.h"

namespace kiln::autodiff {

namespace {

bool is_contiguous(const graph::TensorMeta& meta) {
  int64_t expected = 1;
  for (size_t i = meta.sizes.size(); i-- > 0;) {
    if (meta.sizes[i] != 1 && meta.strides[i] != expected) return false;
    expected *= meta.sizes[i];
  }
  return true;
}

}  // namespace

bool is_recomputed_view(const std::string& qualified_name) {
  return graph::op_facts(qualified_name).cost == graph::OpCost::kView;
}

ValueId copy_constant(const graph::Value& constant, graph::Graph& into) {
  KILN_ASSERT(constant.is_constant) << "value %" << constant.id << " is not a constant";
  graph::Value copy = constant;  // shares the PyObjectRef: no new reference needed
  copy.id = static_cast<ValueId>(into.values.size());
  copy.producer = -1;
  copy.meta.requires_grad = false;
  into.values.push_back(std::move(copy));
  return into.values.back().id;
}

BackwardBuilder::BackwardBuilder(const graph::Graph& forward, graph::Graph& backward, graph::OpOracle& oracle)
    : forward_(forward), backward_(backward), oracle_(oracle) {}

ValueId BackwardBuilder::forward_value(ValueId forward_id) {
  auto found = forward_to_backward_.find(forward_id);
  if (found != forward_to_backward_.end()) return found->second;
  const graph::Value& v = forward_.value(forward_id);
  ValueId result = -1;
  if (v.is_constant) {
    result = copy_constant(v, backward_);
  } else if (v.producer >= 0 && is_recomputed_view(forward_.nodes[v.producer].qualified_name()) &&
             forward_.nodes[v.producer].outputs.size() == 1) {
    graph::Node node = forward_.nodes[v.producer];
    for (graph::ArgValue& arg : node.args)
      if (auto* t = std::get_if<graph::TensorArg>(&arg)) t->id = forward_value(t->id);
    graph::TensorMeta meta = v.meta;
    meta.requires_grad = false;
    result = backward_.add_node(std::move(node), {meta}).front();
  } else {
    graph::TensorMeta meta = v.meta;
    meta.requires_grad = false;
    result = backward_.add_input(meta);
    saved_order_.push_back(forward_id);
  }
  forward_to_backward_[forward_id] = result;
  return result;
}

std::vector<ValueId> BackwardBuilder::emit_all(const std::string& op, const std::string& overload, std::vector<Arg> args) {
  graph::Node node;
  node.op = op;
  node.overload = overload;
  node.args = std::move(args);
  std::vector<graph::TensorMeta> metas = oracle_.complete_node(backward_, node);
  for (auto& m : metas) m.requires_grad = false;
  return backward_.add_node(std::move(node), std::move(metas));
}

ValueId BackwardBuilder::emit(const std::string& op, const std::string& overload, std::vector<Arg> args) {
  std::vector<ValueId> outs = emit_all(op, overload, std::move(args));
  KILN_ASSERT_EQ(outs.size(), 1u) << "results of " << op << "." << overload;
  return outs.front();
}

ValueId BackwardBuilder::add(ValueId a, ValueId b) { return emit("aten::add", "Tensor", {tensor(a), tensor(b), int64_t{1}}); }
ValueId BackwardBuilder::mul(ValueId a, ValueId b) { return emit("aten::mul", "Tensor", {tensor(a), tensor(b)}); }
ValueId BackwardBuilder::mul(ValueId a, double scalar) {
  if (scalar == 1.0) return a;
  return emit("aten::mul", "Tensor", {tensor(a), scalar});
}
ValueId BackwardBuilder::div(ValueId a, ValueId b) { return emit("aten::div", "Tensor", {tensor(a), tensor(b)}); }
ValueId BackwardBuilder::neg(ValueId a) { return emit("aten::neg", "default", {tensor(a)}); }
ValueId BackwardBuilder::transpose(ValueId a, int64_t dim0, int64_t dim1) {
  return emit("aten::transpose", "int", {tensor(a), dim0, dim1});
}

ValueId BackwardBuilder::reshape(ValueId a, const std::vector<int64_t>& sizes) {
  if (meta(a).sizes == sizes) return a;
  if (is_contiguous(meta(a))) return emit("aten::view", "default", {tensor(a), sizes});
  return emit("aten::reshape", "default", {tensor(a), sizes});
}

ValueId BackwardBuilder::expand(ValueId a, const std::vector<int64_t>& sizes) {
  if (meta(a).sizes == sizes) return a;
  return emit("aten::expand", "default", {tensor(a), sizes, false});
}

namespace {

// The shape whose dims split both `a` and `b` (same element count) into common factors, dropping size-1 dims:
// (128, 256, 64) and (128, 32, 512) give (128, 32, 8, 64). Empty when there is none (a boundary of one does not
// divide the next of the other: (6, 4) and (4, 6)).
std::vector<int64_t> common_refinement(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> bounds;  // prefix products of either shape, ascending
  for (const auto* shape : {&a, &b}) {
    int64_t p = 1;
    for (int64_t s : *shape) bounds.push_back(p *= s);
  }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  std::vector<int64_t> dims;
  int64_t previous = 1;
  for (int64_t bound : bounds) {
    if (bound == previous) continue;
    if (previous == 0 || bound % previous != 0) return {};
    dims.push_back(bound / previous);
    previous = bound;
  }
  return dims;
}

}  // namespace

std::optional<ValueId> BackwardBuilder::stack_through_reshapes(const graph::TensorListArg& pieces, int64_t position) {
  // stack(reshape(x_i, S), d) is view(stack(view(x_i, R), d'), S with the new dim at d) when every piece is a
  // reshape of a same-shaped x_i and R refines both x_i's shape and S with a boundary at d: the stack then
  // reads the x_i through their strides, where each reshape would have copied first.
  std::vector<ValueId> sources;
  for (const auto& piece : pieces.ids) {
    const graph::Value& v = backward_.value(*piece);
    if (v.producer < 0) return std::nullopt;
    const graph::Node& node = backward_.nodes[v.producer];
    if (node.qualified_name() != "aten::reshape.default") return std::nullopt;
    const auto* source = std::get_if<graph::TensorArg>(&node.args.at(0));
    if (!source || (!sources.empty() && meta(source->id).sizes != meta(sources.front()).sizes)) return std::nullopt;
    sources.push_back(source->id);
  }
  if (sources.empty()) return std::nullopt;
  const std::vector<int64_t>& piece_sizes = meta(*pieces.ids.front()).sizes;
  const std::vector<int64_t> refined = common_refinement(meta(sources.front()).sizes, piece_sizes);
  if (refined.empty()) return std::nullopt;
  int64_t before = 1;  // elements of one piece before the stack dim
  for (int64_t i = 0; i < position; ++i) before *= piece_sizes[i];
  int64_t refined_position = 0, product = 1;
  while (product < before && refined_position < static_cast<int64_t>(refined.size())) product *= refined[refined_position++];
  if (product != before) return std::nullopt;
  graph::TensorListArg views;
  for (ValueId source : sources) views.ids.push_back(emit("aten::view", "default", {tensor(source), refined}));
  const ValueId stacked = emit("aten::stack", "default", {views, refined_position});
  std::vector<int64_t> sizes = piece_sizes;
  sizes.insert(sizes.begin() + position, static_cast<int64_t>(pieces.ids.size()));
  return emit("aten::view", "default", {tensor(stacked), sizes});
}

ValueId BackwardBuilder::stack_in_order(const graph::TensorListArg& pieces, int64_t dim, const std::vector<int64_t>& order) {
  const auto rank = static_cast<int64_t>(order.size());
  const auto position = static_cast<int64_t>(std::find(order.begin(), order.end(), dim) - order.begin());
  std::vector<int64_t> piece_order;  // a piece's dims (the result's minus `dim`) in memory order
  for (int64_t d : order)
    if (d != dim) piece_order.push_back(d < dim ? d : d - 1);
  std::optional<ValueId> through;
  if (std::is_sorted(piece_order.begin(), piece_order.end())) through = stack_through_reshapes(pieces, position);
  graph::TensorListArg permuted;
  if (!through)
    for (const auto& piece : pieces.ids) permuted.ids.push_back(emit("aten::permute", "default", {tensor(*piece), piece_order}));
  const ValueId stacked = through ? *through : emit("aten::stack", "default", {permuted, position});
  std::vector<int64_t> back(rank);  // result dim d sits at position back[d] of `stacked`
  for (int64_t i = 0; i < rank; ++i) back[order[i]] = i;
  return emit("aten::permute", "default", {tensor(stacked), back});
}

ValueId BackwardBuilder::sum_to(ValueId grad, const std::vector<int64_t>& sizes) {
  const std::vector<int64_t> grad_sizes = meta(grad).sizes;
  if (grad_sizes == sizes) return grad;
  KILN_ASSERT(grad_sizes.size() >= sizes.size()) << "gradient of rank " << grad_sizes.size()
                                                 << " cannot be reduced to rank " << sizes.size();
  const size_t leading = grad_sizes.size() - sizes.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < grad_sizes.size(); ++i) {
    if (i < leading) {
      dims.push_back(static_cast<int64_t>(i));
    } else if (sizes[i - leading] == 1 && grad_sizes[i] != 1) {
      dims.push_back(static_cast<int64_t>(i));
    }
  }
  ValueId reduced = grad;
  if (!dims.empty())
    reduced = emit("aten::sum", "dim_IntList", {tensor(grad), dims, true, graph::NoneArg{}});
  return reshape(reduced, sizes);
}

ValueId BackwardBuilder::to_dtype(ValueId a, graph::ScalarType dtype) {
  if (meta(a).dtype == dtype) return a;
  return emit("aten::_to_copy", "default",
              {tensor(a), graph::ScalarTypeArg{dtype}, graph::NoneArg{}, graph::NoneArg{}, graph::NoneArg{}, false,
               graph::NoneArg{}});
}

ValueId BackwardBuilder::grad_for(ValueId grad, ValueId forward_id) {
  const graph::TensorMeta& target = forward_meta(forward_id);
  return to_dtype(sum_to(grad, target.sizes), target.dtype);
}

}  // namespace kiln::autodiff
