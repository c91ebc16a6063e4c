// The kernel scheduler.
//
// Design: one walk over the nodes in order. A node with a decomposition joins an existing kernel when it
// is compatible (same domain and reduced dims, operands that line up with the kernel's loop variables,
// external operands produced by earlier steps), else it opens a new kernel; any other node is an extern
// call whose tensor arguments get materialised. The candidates tried, in order, are the kernels that
// define the node's operands (vertical fusion: prologues, epilogues, reductions) and then the most recent
// kernel (horizontal fusion of independent work over the same domain).
//
// Every value inside a kernel carries a *dim map*: for each of its dims, the domain dim it runs along
// (-1 for a kept size-1 dim). A pointwise op whose shape equals the domain runs along all dims; one whose
// shape equals the domain with the reduced dims removed (or kept as 1) runs once per outer index, so
// `x - x.amax(-1, keepdim=True)` and `x.sum(-1) * 2` both stay in the reduction's kernel.
//
// Views are not kernel nodes: an affine view is an index expression on its root's storage, so only the root
// has to exist as a tensor. A view that must exist as a tensor itself (a graph output, an extern argument)
// is run as an extern call, which gives exactly eager's aliasing.
//
// Padding and pooling read their operand at shifted or windowed indices (fusion/window_reads.h). A pooling
// node opens a kernel whose domain is its output's shape followed by the window's dims (reduced). Its operand,
// when a small pointwise producer computes it and nobody materialised it yet (BatchNorm + ReLU before a
// max pool), is recomputed per window element from the producer's own loads, guarded by the bounds
// predicate, as torch.compile does: the producer's result is never written to memory. Otherwise the operand is
// materialised and loaded through the guard.
#include "fusion/schedule_kernels.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "common/error.h"
#include "decomp/decompositions.h"
#include "fusion/window_reads.h"

namespace kiln::fusion {

using decomp::Prim;
using decomp::PrimOp;
using decomp::ReduceOp;
using graph::Graph;
using graph::Node;
using graph::NodeIndex;
using graph::ScalarType;
using graph::ValueId;

namespace {

using DimMap = std::vector<int>;

constexpr int32_t kNotAvailable = 1 << 30;
// A producer is recomputed per window element only when it is this small (BatchNorm + ReLU: about 15).
constexpr int kMaxRecomputedExprs = 48;

struct KernelHome {
  int32_t kernel = -1;
  int32_t expr = -1;
  DimMap dims;
};

// `shape` as a value of a kernel over `domain` with `reduced` dims: identity, reduced dims kept as 1, or
// reduced dims dropped.
std::optional<DimMap> match_domain(const std::vector<int64_t>& shape, const std::vector<int64_t>& domain,
                                   const std::vector<bool>& reduced) {
  const int rank = static_cast<int>(domain.size());
  DimMap identity(rank);
  for (int d = 0; d < rank; ++d) identity[d] = d;
  if (shape == domain) return identity;
  if (std::find(reduced.begin(), reduced.end(), true) == reduced.end()) return std::nullopt;
  std::vector<int64_t> keep = domain, kept;
  DimMap keep_map = identity, kept_map;
  for (int d = 0; d < rank; ++d) {
    if (reduced[d]) {
      keep[d] = 1;
      keep_map[d] = -1;
    } else {
      kept.push_back(domain[d]);
      kept_map.push_back(d);
    }
  }
  if (shape == keep) return keep_map;
  if (shape == kept) return kept_map;
  return std::nullopt;
}

class Scheduler;

// A Python number converted like a C++ static_cast to `t` (kept unrounded for half/bfloat16, which PyTorch
// also applies in float).
double convert_constant(double v, ScalarType t) {
  if (t == ScalarType::Bool) return v != 0 ? 1 : 0;
  if (!graph::is_floating_or_complex(t)) return std::trunc(v);
  if (t == ScalarType::Float) return static_cast<double>(static_cast<float>(v));
  return v;
}

// Implements decomp's PrimBuilder by appending loop-IR expressions to one kernel.
class KernelPrimBuilder final : public decomp::PrimBuilder {
 public:
  KernelPrimBuilder(Scheduler& s, int32_t kernel, const Node& node, DimMap node_space,
                    std::vector<int64_t> node_shape, std::vector<DimMap> output_maps)
      : s_(s), kernel_(kernel), node_(node), node_space_(std::move(node_space)),
        node_shape_(std::move(node_shape)), output_maps_(std::move(output_maps)) {}

  Prim arg(int arg_index) override;
  Prim padded_arg(int arg_index, const std::vector<decomp::DimAccess>& dims, double fill) override;
  Prim padded_list_element(int arg_index, int element, const std::vector<decomp::DimAccess>& dims, double fill) override;
  Prim in_bounds(const std::vector<decomp::DimAccess>& dims, const std::vector<int64_t>& extents) override;
  Prim gather(int source_arg, int source_dim, const std::vector<int>& source_dims, int index_arg,
              const std::vector<int>& index_dims) override;
  Prim iota(int dim) override;
  Prim constant(double value, ScalarType dtype) override {
    Expr e{ExprKind::Constant, dtype};
    e.constant = value;
    return add(std::move(e));
  }
  Prim unary(PrimOp op, Prim a) override {
    Expr e{ExprKind::Unary, decomp::has_bool_result(op) ? ScalarType::Bool : dtype(a)};
    e.op = op;
    e.operands[0] = a;
    return add(std::move(e));
  }
  Prim binary(PrimOp op, Prim a, Prim b) override {
    Expr e{ExprKind::Binary, decomp::has_bool_result(op) ? ScalarType::Bool : dtype(a)};
    e.op = op;
    e.operands[0] = a;
    e.operands[1] = b;
    return add(std::move(e));
  }
  Prim where(Prim c, Prim a, Prim b) override {
    Expr e{ExprKind::Where, dtype(a)};
    e.operands[0] = c;
    e.operands[1] = a;
    e.operands[2] = b;
    return add(std::move(e));
  }
  Prim cast(Prim a, ScalarType t) override;
  Prim reduce(ReduceOp op, Prim a) override;
  ScalarType dtype(Prim a) const override;
  int64_t reduction_size() const override;
  void set_output(int index, Prim value) override;

 private:
  Prim add(Expr e);
  WindowMap window_map(const std::vector<decomp::DimAccess>& dims) const;

  Scheduler& s_;
  int32_t kernel_;
  const Node& node_;
  DimMap node_space_;
  std::vector<int64_t> node_shape_;
  std::vector<DimMap> output_maps_;
};

class Scheduler {
 public:
  explicit Scheduler(const Graph& g)
      : g_(g), home_(g.values.size()), available_(g.values.size(), kNotAvailable),
        view_root_(g.values.size(), -1), defining_node_(g.values.size(), -1), constants_(g.values.size()) {
    for (const graph::Value& v : g.values)
      if (v.is_input || v.is_constant) available_[v.id] = -1;
    readers_.resize(g.values.size());
    loading_kernels_.resize(g.values.size());
    for (NodeIndex n = 0; n < static_cast<NodeIndex>(g.nodes.size()); ++n)
      for (const graph::ArgValue& arg : g.nodes[n].args) graph::for_each_tensor(arg, [&](ValueId v) { readers_[v].push_back(n); });
  }

  Schedule run() {
    for (NodeIndex n = 0; n < static_cast<NodeIndex>(g_.nodes.size()); ++n) schedule_node(n);
    for (ValueId out : g_.outputs) need_tensor(out);
    finish();
    return std::move(schedule_);
  }

  // ---- used by KernelPrimBuilder ----
  Kernel& kernel(int32_t k) { return schedule_.kernels[k]; }
  const Graph& graph() const { return g_; }
  const KernelHome& home(ValueId v) const { return home_[v]; }
  void set_home(ValueId v, KernelHome h) { home_[v] = std::move(h); }
  const std::optional<std::pair<double, ScalarType>>& constant(ValueId v) const { return constants_[v]; }

  // Load of tensor `v` (a view or a materialised value) into kernel k at the node's index space, broadcast: v's
  // dims are the node's last ones.
  Prim load(int32_t k, ValueId v, const DimMap& node_space, const std::vector<int64_t>& node_shape) {
    const size_t rank = g_.value(v).meta.sizes.size();
    std::vector<int> dims(rank);
    for (size_t j = 0; j < rank; ++j) dims[j] = static_cast<int>(node_shape.size() - rank + j);
    return mapped_load(k, v, node_space, dims);
  }

  // Load of tensor `v` into kernel k with its dims placed explicitly: v's dim j runs along node dim dims[j] (-1: not
  // at all, for a gathered dim). `gathered_dim` >= 0 makes it a gathered load along that dim, at `index`'s value.
  Prim mapped_load(int32_t k, ValueId v, const DimMap& node_space, const std::vector<int>& dims, int gathered_dim = -1,
                   Prim index = -1) {
    const ValueId root = view_root_[v] >= 0 ? view_root_[v] : v;
    need_tensor(root);
    Kernel& kern = kernel(k);
    const auto& vm = g_.value(v).meta;
    KILN_ASSERT_EQ(dims.size(), vm.sizes.size()) << "mapped load of %" << v << ": one node dim per dim";
    Expr e{ExprKind::Load, vm.dtype};
    e.index.offset = vm.storage_offset - g_.value(root).meta.storage_offset;
    e.index.strides.assign(kern.domain.size(), 0);
    for (size_t j = 0; j < vm.sizes.size(); ++j) {
      if (static_cast<int>(j) == gathered_dim) {
        e.operands[1] = index;
        e.gather_stride = vm.strides[j];
        e.gather_extent = vm.sizes[j];
        continue;
      }
      if (vm.sizes[j] == 1 || dims[j] < 0) continue;
      const int d = node_space.at(dims[j]);
      if (d >= 0) e.index.strides[d] += vm.strides[j];
    }
    e.buffer = buffer_for(k, root, false);
    return add_expr(k, std::move(e));
  }

  // Padded or windowed read of tensor `v` into kernel k (decomp::PrimBuilder::padded_arg): its pointwise
  // producer recomputed through `map` (recompute_instead), or the tensor loaded through the bounds guard.
  Prim padded_load(int32_t k, ValueId v, const WindowMap& map, double fill) {
    const auto& vm = g_.value(v).meta;
    if (const auto& c = constants_[v]) {
      KILN_ASSERT(map.dims.empty()) << "a padded read of the 0-d constant %" << v << " at a rank-" << map.dims.size() << " index";
      Expr e{ExprKind::Constant, c->second};
      e.constant = c->first;
      return add_expr(k, std::move(e));
    }
    KILN_ASSERT_EQ(vm.sizes.size(), map.dims.size()) << "padded read of %" << v << ": one access per dim";
    std::vector<Bound> bounds = map.bounds(vm.sizes);
    Prim guard = -1;
    if (!bounds.empty()) {
      Expr e{ExprKind::InBounds, ScalarType::Bool};
      e.bounds = std::move(bounds);
      guard = add_expr(k, std::move(e));
    }
    const double fill_value = convert_constant(fill, vm.dtype);
    if (recompute_instead(v, k)) {
      const KernelHome& h = home_[v];
      const Prim value = recompute_through(
          kernel(h.kernel), h.expr, map, map.bounded_dims(vm.sizes), guard, [&](Expr e) { return add_expr(k, std::move(e)); },
          [&](ValueId buffer) { return buffer_for(k, buffer, false); });
      if (guard < 0) return value;
      Expr fill_expr{ExprKind::Constant, vm.dtype};
      fill_expr.constant = fill_value;
      Expr select{ExprKind::Where, vm.dtype};
      select.operands[0] = guard;
      select.operands[1] = value;
      select.operands[2] = add_expr(k, std::move(fill_expr));
      return add_expr(k, std::move(select));
    }
    const ValueId root = view_root_[v] >= 0 ? view_root_[v] : v;
    need_tensor(root);
    IndexExpr source;
    source.offset = vm.storage_offset - g_.value(root).meta.storage_offset;
    source.strides = vm.strides;
    Expr e{ExprKind::Load, vm.dtype};
    e.buffer = buffer_for(k, root, false);
    e.index = map.compose(source);
    if (guard >= 0) {
      e.operands[0] = guard;
      e.constant = fill_value;
    }
    return add_expr(k, std::move(e));
  }

  Prim add_expr(int32_t k, Expr e) {
    // Structural CSE inside the kernel: one load per (buffer, index), one value per identical prim.
    Kernel& kern = kernel(k);
    std::ostringstream key;
    key << static_cast<int>(e.kind) << ',' << static_cast<int>(e.dtype) << ',' << static_cast<int>(e.op) << ','
        << static_cast<int>(e.reduce_op) << ',' << e.operands[0] << ',' << e.operands[1] << ',' << e.operands[2]
        << ',' << e.buffer << ',' << e.index.offset << ',' << e.gather_stride << ',' << e.gather_extent;
    key.precision(17);
    key << ',' << e.constant;
    for (int64_t s : e.index.strides) key << ',' << s;
    for (const Bound& b : e.bounds) {
      key << ";" << b.extent << ',' << b.index.offset;
      for (int64_t s : b.index.strides) key << ',' << s;
    }
    // Reductions are never merged: two equal sums are rare and keeping them apart keeps codegen simple.
    if (e.kind != ExprKind::Reduce) {
      auto [it, inserted] = expr_keys_[k].emplace(key.str(), static_cast<int32_t>(kern.exprs.size()));
      if (!inserted) return it->second;
    }
    kern.exprs.push_back(std::move(e));
    return static_cast<Prim>(kern.exprs.size() - 1);
  }

 private:
  int32_t buffer_for(int32_t k, ValueId v, bool is_output) {
    Kernel& kern = kernel(k);
    for (size_t i = 0; i < kern.buffers.size(); ++i)
      if (kern.buffers[i].value == v && kern.buffers[i].is_output == is_output) return static_cast<int32_t>(i);
    kern.buffers.push_back({v, g_.value(v).meta.dtype, is_output});
    if (!is_output) loading_kernels_[v].push_back(k);
    return static_cast<int32_t>(kern.buffers.size() - 1);
  }

  int32_t append_step(Step::Kind kind, int32_t index) {
    schedule_.steps.push_back({kind, index});
    return static_cast<int32_t>(schedule_.steps.size() - 1);
  }

  // Makes `v` a real tensor at run time; returns the step after which it exists (-1: from the start).
  int32_t need_tensor(ValueId v) {
    if (available_[v] != kNotAvailable) return available_[v];
    if (view_root_[v] >= 0 || constants_[v]) {
      const Node& node = g_.nodes[defining_node_[v]];
      for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId a) { need_tensor(a); });
      const int32_t step = append_step(Step::Kind::Extern, defining_node_[v]);
      for (ValueId out : node.outputs) available_[out] = step;
      return step;
    }
    const KernelHome& h = home_[v];
    KILN_ASSERT(h.kernel >= 0) << "value %" << v << " is needed as a tensor but no step defines it";
    Kernel& kern = kernel(h.kernel);
    Store store{buffer_for(h.kernel, v, true), h.expr, {}};
    const auto& vm = g_.value(v).meta;
    store.index.strides.assign(kern.domain.size(), 0);
    for (size_t j = 0; j < vm.sizes.size(); ++j)
      if (h.dims[j] >= 0 && vm.sizes[j] != 1) store.index.strides[h.dims[j]] += vm.strides[j];
    kern.stores.push_back(std::move(store));
    available_[v] = kernel_step_[h.kernel];
    return available_[v];
  }

  // True when a padded read of `v` into kernel k should recompute it there rather than load it: a value of a
  // pointwise kernel (over exactly its shape) that is not a tensor yet, computed from at most
  // kMaxRecomputedExprs expressions whose loads kernel k can make too.
  bool recompute_instead(ValueId v, int32_t k) const {
    if (available_[v] != kNotAvailable || view_root_[v] >= 0 || constants_[v] || home_[v].kernel < 0) return false;
    const KernelHome& h = home_[v];
    const Kernel& from = schedule_.kernels[h.kernel];
    if (from.has_reduction() || from.domain != g_.value(v).meta.sizes) return false;
    for (size_t j = 0; j < h.dims.size(); ++j)
      if (h.dims[j] != static_cast<int>(j)) return false;
    const int size = recompute_size(from, h.expr);
    if (size < 0 || size > kMaxRecomputedExprs) return false;
    for (const KernelBuffer& b : from.buffers)
      if (!b.is_output && load_step(b.value, k) >= kernel_step_[k]) return false;
    return true;
  }

  // The step after which `v` can be loaded, without side effects (kNotAvailable if never).
  int32_t load_step(ValueId v, int32_t into_kernel) const {
    const ValueId root = view_root_[v] >= 0 ? view_root_[v] : v;
    if (available_[root] != kNotAvailable) return available_[root];
    const KernelHome& h = home_[root];
    if (h.kernel < 0 || h.kernel == into_kernel) return kNotAvailable;  // never load what this kernel stores
    return kernel_step_[h.kernel];
  }

  void schedule_node(NodeIndex n) {
    const Node& node = g_.nodes[n];
    ScalarType constant_dtype;
    if (auto value = decomp::constant_node_value(g_, node, constant_dtype)) {
      constants_[node.outputs[0]] = std::make_pair(*value, constant_dtype);
      defining_node_[node.outputs[0]] = n;
      return;
    }
    if (decomp::is_affine_view(g_, node)) {
      const ValueId base = std::get<graph::TensorArg>(node.args[0]).id;
      const ValueId out = node.outputs[0];
      defining_node_[out] = n;
      if (constants_[base]) {  // a view of an inlined constant: just run it
        schedule_extern(n);
        return;
      }
      view_root_[out] = view_root_[base] >= 0 ? view_root_[base] : base;
      return;
    }
    if (copy_as_store(n)) return;
    const decomp::Decomposition* d = decomp::find_decomposition(g_, node);
    if (!d) {
      schedule_extern(n);
      return;
    }
    std::vector<int32_t> candidates;
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](ValueId v) {
        if (home_[v].kernel >= 0) candidates.push_back(home_[v].kernel);
      });
    std::sort(candidates.rbegin(), candidates.rend());
    const size_t operand_kernels = candidates.size();
    // Horizontal candidates: the kernels that already load one of n's operands, latest first (n reads those bytes
    // there once more for nothing: SwiGLU's gradient reads the gate, the up projection and the incoming gradient in
    // two kernels otherwise, one each side of the matmul that reads the first one's result), then the last kernel.
    std::vector<int32_t> loaders;
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](ValueId v) {
        const ValueId root = view_root_[v] >= 0 ? view_root_[v] : v;
        loaders.insert(loaders.end(), loading_kernels_[root].begin(), loading_kernels_[root].end());
      });
    std::sort(loaders.rbegin(), loaders.rend());
    for (int32_t k : loaders)
      if (std::find(candidates.begin(), candidates.end(), k) == candidates.end()) candidates.push_back(k);
    if (!schedule_.kernels.empty()) candidates.push_back(static_cast<int32_t>(schedule_.kernels.size()) - 1);
    for (size_t c = 0; c < candidates.size(); ++c)
      if (try_fuse(candidates[c], n, *d, /*horizontal=*/c >= operand_kernels)) return;
    // A fresh kernel over the node's own domain.
    Kernel fresh;
    if (d->reduction_dims) {
      fresh.domain = g_.value(std::get<graph::TensorArg>(node.args[0]).id).meta.sizes;
    } else {
      fresh.domain = g_.value(node.outputs[0]).meta.sizes;
    }
    fresh.reduced.assign(fresh.domain.size(), false);
    if (d->window_sizes) {  // the output's dims, then the window's (reduced)
      for (int64_t size : d->window_sizes(g_, node)) {
        fresh.domain.push_back(size);
        fresh.reduced.push_back(true);
      }
      fresh.window_reduction = true;
    }
    schedule_.kernels.push_back(std::move(fresh));
    expr_keys_.emplace_back();
    kernel_step_.push_back(append_step(Step::Kind::Kernel, static_cast<int32_t>(schedule_.kernels.size()) - 1));
    const bool fused = try_fuse(static_cast<int32_t>(schedule_.kernels.size()) - 1, n, *d);
    KILN_ASSERT(fused) << "node " << n << " (" << node.qualified_name() << ") does not fit its own kernel";
  }

  // For a view of a kernel's value that only permutes its dims (same sizes and strides, dim for dim): the
  // kernel's domain dim each of the view's dims runs along (-1 for size-1 dims), the kernel, and the value's
  // expression. nullopt for other views and values.
  struct PermutedValue {
    int32_t kernel;
    int32_t expr;
    DimMap dims;
  };
  std::optional<PermutedValue> permuted_kernel_value(ValueId view) const {
    if (view_root_[view] < 0) return std::nullopt;
    const ValueId root = view_root_[view];
    const KernelHome& h = home_[root];
    if (h.kernel < 0) return std::nullopt;
    const auto& vm = g_.value(view).meta;
    const auto& rm = g_.value(root).meta;
    if (vm.dtype != rm.dtype || vm.storage_offset != rm.storage_offset) return std::nullopt;
    int64_t numel_view = 1, numel_root = 1;
    for (int64_t s : vm.sizes) numel_view *= s;
    for (int64_t s : rm.sizes) numel_root *= s;
    if (numel_view != numel_root) return std::nullopt;
    DimMap dims(vm.sizes.size(), -1);
    std::vector<bool> used(rm.sizes.size(), false);
    for (size_t j = 0; j < vm.sizes.size(); ++j) {
      if (vm.sizes[j] == 1) continue;
      size_t i = 0;
      while (i < rm.sizes.size() && (used[i] || rm.sizes[i] != vm.sizes[j] || rm.strides[i] != vm.strides[j])) ++i;
      if (i == rm.sizes.size() || h.dims[i] < 0) return std::nullopt;
      used[i] = true;
      dims[j] = h.dims[i];
    }
    return PermutedValue{h.kernel, h.expr, std::move(dims)};
  }

  // clone(permute(y)) or reshape(permute(y)) where y is a value of a kernel: y's own expression stored once
  // more, in the result's layout (a transposed store from that kernel), rather than a copy that loads y back.
  // nn.MultiheadAttention's batch_first transpose of the layer norm's output becomes the layer norm kernel's
  // store; in the backward, the attention output's gradient is stored transposed by the kernel that adds it.
  bool copy_as_store(NodeIndex n) {
    const Node& node = g_.nodes[n];
    const std::string name = node.qualified_name();
    const bool clone = name == "aten::clone.default", reshape = name == "aten::reshape.default";
    if ((!clone && !reshape) || node.outputs.size() != 1) return false;
    const auto* operand = std::get_if<graph::TensorArg>(&node.args.at(0));
    if (!operand) return false;
    std::optional<PermutedValue> source = permuted_kernel_value(operand->id);
    if (!source) return false;
    const ValueId out = node.outputs[0];
    const auto& vm = g_.value(operand->id).meta;
    const auto& om = g_.value(out).meta;
    if (om.dtype != vm.dtype) return false;
    if (clone) {
      if (om.sizes != vm.sizes) return false;
      home_[out] = KernelHome{source->kernel, source->expr, std::move(source->dims)};
    } else {
      // The reshape's result is contiguous: the view's elements in their logical order, whatever its shape.
      if (om.storage_offset != 0 || om.strides != graph::contiguous_strides(om.sizes)) return false;
      Kernel& kern = kernel(source->kernel);
      Store store{buffer_for(source->kernel, out, true), source->expr, {}};
      store.index.strides.assign(kern.domain.size(), 0);
      const std::vector<int64_t> order = graph::contiguous_strides(vm.sizes);
      for (size_t j = 0; j < vm.sizes.size(); ++j)
        if (source->dims[j] >= 0) store.index.strides[source->dims[j]] += order[j];
      kern.stores.push_back(std::move(store));
      available_[out] = kernel_step_[source->kernel];
    }
    defining_node_[out] = n;
    kernel(source->kernel).nodes.push_back(n);
    return true;
  }

  void schedule_extern(NodeIndex n) {
    const Node& node = g_.nodes[n];
    for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId v) { need_tensor(v); });
    const int32_t step = append_step(Step::Kind::Extern, n);
    for (ValueId out : node.outputs) available_[out] = step;
  }

  // Whether `v`, through the pointwise nodes that read it, feeds a reduction over a value of kern's domain but
  // over other dims than kern's (a layer norm's x_hat: its input gradient sums rows, its weight gradient columns).
  bool feeds_other_reduction(ValueId v, const Kernel& kern, int depth = 0) const {
    if (depth > 8) return false;
    for (NodeIndex r : readers_[v]) {
      const Node& reader = g_.nodes[r];
      const decomp::Decomposition* d = decomp::find_decomposition(g_, reader);
      if (!d || reader.is_view || d->window_sizes || reader.outputs.empty()) continue;
      if (d->reduction_dims) {
        if (g_.value(std::get<graph::TensorArg>(reader.args[0]).id).meta.sizes != kern.domain) continue;
        std::vector<bool> wanted(kern.domain.size(), false);
        for (int64_t dim : d->reduction_dims(g_, reader)) wanted[dim] = true;
        if (wanted != kern.reduced) return true;
        continue;
      }
      if (feeds_other_reduction(reader.outputs[0], kern, depth + 1)) return true;
    }
    return false;
  }

  // Checks that node n fits kernel k; if so, builds it there and returns true. `horizontal`: k computes none of
  // n's operands. A pointwise node then joins a reduction kernel along its reduced loops only where its own later
  // reductions could join it too (feeds_other_reduction: a layer norm's input gradient, next to its weight
  // gradient's column sums, could not).
  bool try_fuse(int32_t k, NodeIndex n, const decomp::Decomposition& d, bool horizontal = false) {
    const Node& node = g_.nodes[n];
    Kernel& kern = kernel(k);
    std::vector<bool> reduced = kern.reduced;
    DimMap node_space;
    std::vector<int64_t> node_shape;
    if (d.window_sizes) {
      // Only a window kernel over the same output and window (a second pooling of the same shape) takes it.
      node_shape = g_.value(node.outputs[0]).meta.sizes;
      for (int64_t size : d.window_sizes(g_, node)) node_shape.push_back(size);
      if (!kern.window_reduction || node_shape != kern.domain) return false;
      for (size_t i = 0; i < node_shape.size(); ++i) node_space.push_back(static_cast<int>(i));
    } else if (d.reduction_dims) {
      if (kern.window_reduction) return false;
      node_shape = g_.value(std::get<graph::TensorArg>(node.args[0]).id).meta.sizes;
      if (node_shape != kern.domain) return false;
      std::vector<bool> wanted(kern.domain.size(), false);
      for (int64_t dim : d.reduction_dims(g_, node)) wanted[dim] = true;
      const bool kernel_reduces = kern.has_reduction();
      const bool node_reduces = std::find(wanted.begin(), wanted.end(), true) != wanted.end();
      if (kernel_reduces && wanted != kern.reduced) return false;
      if (!kernel_reduces && !node_reduces) {
        // a reduction over nothing is pointwise
      } else {
        reduced = wanted;
      }
      for (size_t i = 0; i < node_shape.size(); ++i) node_space.push_back(static_cast<int>(i));
    } else {
      node_shape = g_.value(node.outputs[0]).meta.sizes;
      auto m = match_domain(node_shape, kern.domain, reduced);
      if (!m) return false;
      node_space = *m;
    }
    std::vector<DimMap> output_maps;
    for (int i = 0; i < d.outputs_built; ++i) {
      auto m = match_domain(g_.value(node.outputs[i]).meta.sizes, kern.domain, reduced);
      if (!m) return false;
      output_maps.push_back(*m);
    }
    auto runs_along_reduced = [&](const DimMap& map, const std::vector<int64_t>& sizes, size_t shift) {
      for (size_t j = 0; j < map.size(); ++j)
        if (map[j] >= 0 && reduced[map[j]] && kern.domain[map[j]] != 1 && sizes[j + shift] != 1) return true;
      return false;
    };
    const bool node_is_full = d.reduction_dims || d.window_sizes || runs_along_reduced(node_space, node_shape, 0);
    if (horizontal && kern.has_reduction() && !d.reduction_dims && !d.window_sizes && node_is_full &&
        feeds_other_reduction(node.outputs[0], kern))
      return false;
    // Operands.
    const int32_t step = kernel_step_[k];
    bool ok = true;
    for (const graph::ArgValue& arg : node.args) {
      graph::for_each_tensor(arg, [&](ValueId v) {
        if (!ok || constants_[v]) return;
        if (d.gathered_reads) {  // read at run-time indices: a tensor before this kernel
          ok = home_[v].kernel != k && load_step(v, k) < step;
          return;
        }
        if (d.padded_reads) {  // read at other elements than the node's own: never a value of this loop
          ok = recompute_instead(v, k) || (home_[v].kernel != k && load_step(v, k) < step);
          return;
        }
        const auto& vm = g_.value(v).meta;
        if (vm.sizes.size() > node_shape.size()) {
          ok = false;
          return;
        }
        const size_t shift = node_shape.size() - vm.sizes.size();
        if (home_[v].kernel == k) {
          const DimMap& vmap = home_[v].dims;
          for (size_t j = 0; j < vm.sizes.size() && ok; ++j) {
            if (vm.sizes[j] == 1) continue;
            ok = vm.sizes[j] == node_shape[j + shift] && vmap[j] == node_space[j + shift];
          }
          if (!node_is_full && runs_along_reduced(vmap, vm.sizes, 0)) ok = false;
          return;
        }
        ok = load_step(v, k) < step;
      });
    }
    if (!ok) return false;
    kern.reduced = reduced;
    kern.nodes.push_back(n);
    KernelPrimBuilder builder(*this, k, node, node_space, node_shape, output_maps);
    d.build(builder, g_, node);
    return true;
  }

  void finish() {
    // Kernels whose values nobody needs (dead outputs the passes left) are dropped.
    std::vector<Step> steps;
    for (const Step& s : schedule_.steps)
      if (s.kind == Step::Kind::Extern || !schedule_.kernels[s.index].stores.empty()) steps.push_back(s);
    schedule_.steps = std::move(steps);
    for (size_t k = 0; k < schedule_.kernels.size(); ++k) {
      Kernel& kern = schedule_.kernels[k];
      std::ostringstream name;
      name << "kernel_" << k;
      std::set<std::string> seen;
      int shown = 0;
      for (NodeIndex n : kern.nodes) {
        std::string op = g_.nodes[n].op.substr(g_.nodes[n].op.find("::") + 2);
        while (!op.empty() && op[0] == '_') op.erase(0, 1);
        if (!seen.insert(op).second) continue;
        if (shown++ < 4) name << '_' << op;
      }
      kern.name = name.str();
    }
    schedule_.materialised.assign(g_.values.size(), false);
    for (size_t v = 0; v < g_.values.size(); ++v) schedule_.materialised[v] = available_[v] != kNotAvailable;
  }

  const Graph& g_;
  Schedule schedule_;
  std::vector<KernelHome> home_;
  std::vector<int32_t> available_;   // per value: the step after which it is a tensor
  std::vector<ValueId> view_root_;    // per value: the materialised storage an affine view reads
  std::vector<NodeIndex> defining_node_;  // per view/constant value: its node (run when needed as a tensor)
  std::vector<std::optional<std::pair<double, ScalarType>>> constants_;
  std::vector<int32_t> kernel_step_;  // per kernel: its step index
  std::vector<std::map<std::string, int32_t>> expr_keys_;
  std::vector<std::vector<NodeIndex>> readers_;  // per value: the nodes that read it
  std::vector<std::vector<int32_t>> loading_kernels_;  // per materialised value: the kernels that load it
};

Prim KernelPrimBuilder::arg(int arg_index) {
  const graph::ArgValue& a = node_.args[arg_index];
  if (auto* d = std::get_if<double>(&a)) return constant(*d, ScalarType::Double);
  if (auto* l = std::get_if<int64_t>(&a)) return constant(static_cast<double>(*l), ScalarType::Long);
  if (auto* b = std::get_if<bool>(&a)) return constant(*b ? 1 : 0, ScalarType::Bool);
  auto* t = std::get_if<graph::TensorArg>(&a);
  KILN_ASSERT(t) << "decomposition of " << node_.qualified_name() << " reads argument " << arg_index
                 << " that is neither a tensor nor a number";
  if (const auto& c = s_.constant(t->id)) return constant(c->first, c->second);
  if (s_.home(t->id).kernel == kernel_) return s_.home(t->id).expr;
  return s_.load(kernel_, t->id, node_space_, node_shape_);
}

WindowMap KernelPrimBuilder::window_map(const std::vector<decomp::DimAccess>& dims) const {
  WindowMap map;
  map.dims = dims;
  map.domain = s_.kernel(kernel_).domain;
  const size_t rank = dims.size();
  KILN_ASSERT(node_space_.size() >= rank) << "decomposition of " << node_.qualified_name() << ": a padded read of rank "
                                          << rank << " in an index space of rank " << node_space_.size();
  map.out_dims.assign(node_space_.begin(), node_space_.begin() + rank);
  map.window_dims.assign(node_space_.begin() + rank, node_space_.end());
  for (const decomp::DimAccess& a : dims)
    KILN_ASSERT(a.window_dim < static_cast<int>(map.window_dims.size()))
        << "decomposition of " << node_.qualified_name() << " reads window dim " << a.window_dim << " it does not have";
  return map;
}

Prim KernelPrimBuilder::padded_arg(int arg_index, const std::vector<decomp::DimAccess>& dims, double fill) {
  auto* t = std::get_if<graph::TensorArg>(&node_.args[arg_index]);
  KILN_ASSERT(t) << "decomposition of " << node_.qualified_name() << " pads argument " << arg_index << ", not a tensor";
  return s_.padded_load(kernel_, t->id, window_map(dims), fill);
}

Prim KernelPrimBuilder::padded_list_element(int arg_index, int element, const std::vector<decomp::DimAccess>& dims,
                                            double fill) {
  auto* list = std::get_if<graph::TensorListArg>(&node_.args[arg_index]);
  KILN_ASSERT(list && element >= 0 && element < static_cast<int>(list->ids.size()) && list->ids[element])
      << "decomposition of " << node_.qualified_name() << " pads element " << element << " of argument " << arg_index
      << ", not a tensor of a list";
  return s_.padded_load(kernel_, *list->ids[element], window_map(dims), fill);
}

Prim KernelPrimBuilder::in_bounds(const std::vector<decomp::DimAccess>& dims, const std::vector<int64_t>& extents) {
  std::vector<Bound> bounds = window_map(dims).bounds(extents);
  if (bounds.empty()) return constant(1, ScalarType::Bool);
  Expr e{ExprKind::InBounds, ScalarType::Bool};
  e.bounds = std::move(bounds);
  return add(std::move(e));
}

Prim KernelPrimBuilder::gather(int source_arg, int source_dim, const std::vector<int>& source_dims, int index_arg,
                               const std::vector<int>& index_dims) {
  auto tensor = [&](int i) {
    auto* t = std::get_if<graph::TensorArg>(&node_.args[i]);
    KILN_ASSERT(t) << "decomposition of " << node_.qualified_name() << " gathers through argument " << i << ", not a tensor";
    return t->id;
  };
  const ValueId index_value = tensor(index_arg);
  Prim index;
  if (const auto& c = s_.constant(index_value)) {
    index = constant(c->first, c->second);
  } else {
    index = s_.mapped_load(kernel_, index_value, node_space_, index_dims);
  }
  return s_.mapped_load(kernel_, tensor(source_arg), node_space_, source_dims, source_dim, index);
}

Prim KernelPrimBuilder::iota(int dim) {
  KILN_ASSERT(dim >= 0 && dim < static_cast<int>(node_space_.size()))
      << "decomposition of " << node_.qualified_name() << " asks for the index along dim " << dim << " of "
      << node_space_.size();
  const int d = node_space_[dim];
  if (d < 0) return constant(0, ScalarType::Long);  // a kept size-1 dim
  Expr e{ExprKind::Iota, ScalarType::Long};
  e.index.strides.assign(s_.kernel(kernel_).domain.size(), 0);
  e.index.strides[d] = 1;
  return add(std::move(e));
}

Prim KernelPrimBuilder::cast(Prim a, ScalarType t) {
  if (dtype(a) == t) return a;
  const Expr& source = s_.kernel(kernel_).exprs[a];
  if (source.kind == ExprKind::Constant) return constant(convert_constant(source.constant, t), t);
  Expr e{ExprKind::Cast, t};
  e.operands[0] = a;
  return add(std::move(e));
}

Prim KernelPrimBuilder::reduce(ReduceOp op, Prim a) {
  if (!s_.kernel(kernel_).has_reduction()) return a;  // over no dims (0-d input): the value itself
  Expr e{ExprKind::Reduce, dtype(a)};
  e.reduce_op = op;
  e.operands[0] = a;
  return add(std::move(e));
}

ScalarType KernelPrimBuilder::dtype(Prim a) const { return s_.kernel(kernel_).exprs[a].dtype; }

int64_t KernelPrimBuilder::reduction_size() const {
  const Kernel& k = s_.kernel(kernel_);
  int64_t n = 1;
  for (size_t d = 0; d < k.domain.size(); ++d)
    if (k.reduced[d]) n *= k.domain[d];
  return n;
}

void KernelPrimBuilder::set_output(int index, Prim value) {
  const ValueId out = node_.outputs[index];
  const Prim typed = cast(value, s_.graph().value(out).meta.dtype);
  s_.set_home(out, KernelHome{kernel_, typed, output_maps_[index]});
}

Prim KernelPrimBuilder::add(Expr e) { return s_.add_expr(kernel_, std::move(e)); }

}  // namespace

Schedule schedule_kernels(const Graph& g) { return Scheduler(g).run(); }

}  // namespace kiln::fusion
