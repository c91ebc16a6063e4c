// In-place ops on fresh intermediates become their functional forms (passes/functionalize.h).
//
// Design: one walk in execution order with a renaming map. `relu_(x)` where x is a tensor this graph made
// (not a view, not an input or constant) and nothing has viewed x so far is rewritten as `y = relu(x)`, and
// every later use of x (or of the alias the in-place op returned) reads y instead. That is exactly what
// the mutation did, because nothing else could observe x's storage. Only ops whose in-place and functional
// schemas match argument for argument are converted (those with a functional twin in the op table,
// graph/op_facts.h), and only when every other tensor operand has x's dtype or is bool (a mask; the op table
// says which ops take operands of any dtype, such as indices), so the functional op's type promotion
// gives x's dtype as the in-place op does. A pointwise op whose floating operands promote past x's dtype
// (`y += x` with y bfloat16 from autocast and x float32) computes in the promoted dtype and casts on store, as
// TensorIterator does in place: it becomes the functional op in that dtype and a cast back. Random fills of a
// fresh tensor (uniform_, normal_, ...) become their functional ops, which fill a new tensor from the same generator (the same numbers under the same seed).
// In-place views (squeeze_, t_, transpose_) become views.
#include "passes/functionalize.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "graph/op_facts.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::TensorArg;
using graph::ValueId;

namespace {

// In-place views (squeeze_, t_, transpose_): their functional twin is a view of self.
bool is_inplace_view(const graph::OpFacts& facts) {
  return !facts.functional.empty() && graph::op_facts(facts.functional).view != graph::OpView::kNone;
}

// How many nodes (and graph outputs) read each value of `g`.
std::vector<int32_t> count_readers(const Graph& g) {
  std::vector<int32_t> readers(g.values.size(), 0);
  for (const Node& node : g.nodes)
    for (const ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { ++readers[id]; });
  for (ValueId out : g.outputs) ++readers[out];
  return readers;
}

// The last node (by index in `g.nodes`) that reads each value or any alias of it: a view of it, a view of that view,
// or the result of an in-place op on it; graph outputs read at the end. A write at node i is unobservable through
// an alias made before it exactly when that alias's last read is at i or before.
std::vector<int64_t> alias_last_read(const Graph& g) {
  constexpr int64_t kEnd = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> last(g.values.size(), -1);
  for (ValueId out : g.outputs) last[out] = kEnd;
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const Node& node = g.nodes[i];
    for (const ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](ValueId id) { last[id] = std::max(last[id], static_cast<int64_t>(i)); });
    if (!(node.is_view || node.mutates_args) || node.args.empty()) continue;
    const auto* base = std::get_if<TensorArg>(&node.args[0]);
    if (!base) continue;
    for (ValueId out : node.outputs) last[base->id] = std::max(last[base->id], last[out]);
  }
  return last;
}

// Made by a node that neither views nor writes anything.
bool produced_fresh(const Graph& g, ValueId id) {
  const graph::Value& v = g.values[id];
  if (v.producer < 0) return false;  // inputs and constants have no producer
  const Node& producer = g.nodes[v.producer];
  return !producer.is_view && !producer.mutates_args && !producer.returns_list;
}

// A tensor this graph made that nothing else aliases. A factory's result reaches the graph through the detach the
// recorder puts after it (`torch.zeros(n)`): when that detach is all that reads it, the detach's result is as fresh
// as the factory's.
// Ops that cut their input into disjoint pieces (LSTM and GRU cells: `gates.unsafe_chunk(4, 1)`, then
// `ingate.sigmoid_()`).
bool splits_into_pieces(const Node& node) {
  static const std::unordered_set<std::string> names = {
      "aten::split.Tensor",         "aten::unsafe_split.Tensor", "aten::split_with_sizes.default",
      "aten::unsafe_split_with_sizes.default", "aten::chunk.default", "aten::unsafe_chunk.default", "aten::unbind.int"};
  return node.returns_list && !node.args.empty() && std::holds_alternative<TensorArg>(node.args[0]) &&
         names.count(node.qualified_name());
}

// A view with the elements of its input in the same order: a reshape, an unsqueeze or squeeze, an alias.
bool keeps_element_order(const Node& node) {
  static const std::unordered_set<std::string> names = {"aten::unsqueeze.default", "aten::squeeze.dim",
                                                        "aten::squeeze.dims", "aten::squeeze.default",
                                                        "aten::alias.default"};
  const std::string name = node.qualified_name();
  return graph::op_facts(name).reshape != graph::OpReshape::kNone || names.count(name);
}

bool made_here(const Graph& g, const std::vector<int32_t>& readers, ValueId id) {
  const graph::Value& v = g.values[id];
  if (v.producer < 0) return false;
  const Node& producer = g.nodes[v.producer];
  if (splits_into_pieces(producer)) {
    // A piece of a fresh tensor nothing else reads (the split is its one reader, it is no output): the pieces do not
    // overlap, so each is as fresh as a tensor of its own.
    const ValueId base = std::get<TensorArg>(producer.args[0]).id;
    return readers[base] == 1 && produced_fresh(g, base);
  }
  // A reshape of a tensor nothing else reads (a 4-d matmul's `_unsafe_view` of its bmm, Linear's `view` of its
  // addmm): the base's storage is seen only through it.
  if (producer.is_view && producer.outputs.size() == 1 && !producer.args.empty() && keeps_element_order(producer)) {
    const auto* base = std::get_if<TensorArg>(&producer.args[0]);
    return base && readers[base->id] == 1 && made_here(g, readers, base->id);
  }
  if (producer.qualified_name() == "aten::detach.default" && !producer.args.empty()) {
    const auto* base = std::get_if<TensorArg>(&producer.args[0]);
    return base && readers[base->id] == 1 && produced_fresh(g, base->id);
  }
  return produced_fresh(g, id);
}

bool is_floating(graph::ScalarType t) {
  using graph::ScalarType;
  return t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Float || t == ScalarType::Double;
}

// Type promotion between two floating dtypes: double over float over the 16-bit ones, and half with bfloat16 is float.
graph::ScalarType promote_floating(graph::ScalarType a, graph::ScalarType b) {
  using graph::ScalarType;
  if (a == b) return a;
  if (a == ScalarType::Double || b == ScalarType::Double) return ScalarType::Double;
  return ScalarType::Float;
}

// The dtype in-place pointwise `node` computes in, when its tensor operands are floating: eager's common dtype, where
// dimensioned operands outrank zero-dim ones of the same category. Null when some operand is neither of self's dtype,
// bool nor floating.
std::optional<graph::ScalarType> compute_dtype(const Graph& g, const Node& node) {
  const graph::TensorMeta& self = g.values[std::get<TensorArg>(node.args[0]).id].meta;
  graph::ScalarType dtype = self.dtype;
  bool promotable = true;
  for (size_t a = 1; a < node.args.size(); ++a)
    graph::for_each_tensor(node.args[a], [&](ValueId id) {
      const graph::TensorMeta& m = g.values[id].meta;
      if (m.dtype == self.dtype || m.dtype == graph::ScalarType::Bool) return;
      if (!is_floating(self.dtype) || !is_floating(m.dtype)) promotable = false;
      else if (!m.sizes.empty() || self.sizes.empty()) dtype = promote_floating(dtype, m.dtype);
    });
  if (!promotable) return std::nullopt;
  return dtype;
}

// Rewrites in-place `node` (its self already renamed) as its functional twin when the table and the operand dtypes
// allow it; false (node untouched) otherwise. `computes_in`: the dtype the twin's result has, self's unless a
// pointwise op's floating operands promote past it (the caller then casts the result back); null: refuse that case.
bool make_functional(const Graph& g, Node& node, graph::ScalarType* computes_in) {
  const graph::OpFacts& facts = graph::op_facts(node.qualified_name());
  if (facts.functional.empty() || node.args.empty() || node.outputs.size() != 1) return false;
  const auto* self = std::get_if<TensorArg>(&node.args[0]);
  if (!self) return false;
  const graph::ScalarType self_dtype = g.values[self->id].meta.dtype;
  if (computes_in) *computes_in = self_dtype;
  if (!facts.any_operand_dtype) {
    const std::optional<graph::ScalarType> dtype = compute_dtype(g, node);
    const bool pointwise = graph::op_facts(facts.functional).layout == graph::OpLayout::kFollowsOperands;
    if (!dtype || (*dtype != self_dtype && (!pointwise || !computes_in))) return false;
    if (computes_in) *computes_in = *dtype;
  }
  std::tie(node.op, node.overload) = graph::split_qualified_name(facts.functional);
  if (is_inplace_view(facts)) node.is_view = true;  // y = squeeze(x) aliases x like any view
  node.mutates_args = false;
  return true;
}

class Functionalize {
 public:
  explicit Functionalize(Graph& g)
      : g_(g), rw_(g), current_(g.values.size()), readers_(count_readers(g)), last_read_(alias_last_read(g)) {
    for (size_t v = 0; v < current_.size(); ++v) current_[v] = static_cast<ValueId>(v);
  }

  bool run() {
    int64_t position = 0;
    for (Node& node : rw_.take_nodes()) {
      rename_args(node);
      if (node.is_view) {
        int64_t until = -1;
        for (ValueId out : node.outputs) until = std::max(until, last_read_[out]);
        for (const ArgValue& arg : node.args)
          graph::for_each_tensor(arg, [&](ValueId id) { viewed_until_[id] = std::max(viewed_until_[id], until); });
      }
      if (node.mutates_args) convert(node, position);
      else rw_.append(std::move(node));
      ++position;
    }
    for (ValueId& out : g_.outputs) out = current_[out];
    return changed_;
  }

 private:
  void rename_args(Node& node) {
    for (ArgValue& arg : node.args) graph::remap_tensors(arg, [&](ValueId id) { return current_[id]; });
  }

  // Made here, and no view of it made so far is read after node `position` (which would see the write).
  bool fresh(ValueId id, int64_t position) const {
    auto it = viewed_until_.find(id);
    return (it == viewed_until_.end() || it->second <= position) && made_here(g_, readers_, id);
  }

  // Appends `node` (at `position` in the graph as given), made functional where it can be.
  void convert(Node& node, int64_t position) {
    const auto* self = node.args.empty() ? nullptr : std::get_if<TensorArg>(&node.args[0]);
    graph::ScalarType computes_in{};
    if (!self || !fresh(self->id, position) || !make_functional(g_, node, &computes_in)) {
      rw_.append(std::move(node));
      return;
    }
    const ValueId mutated = self->id;
    const ValueId result = node.outputs[0];
    if (computes_in != g_.values[result].meta.dtype) {
      // The twin's result in the promoted dtype, laid out as self, then cast into the value the in-place op made.
      graph::TensorMeta wide = g_.values[result].meta;
      wide.dtype = computes_in;
      graph::Value v;
      v.id = static_cast<ValueId>(g_.values.size());
      v.meta = wide;
      g_.values.push_back(std::move(v));
      node.outputs[0] = g_.values.back().id;
      const ValueId computed = node.outputs[0];
      rw_.append(std::move(node));
      rw_.cast(computed, g_.values[result].meta.dtype, result);
    } else {
      rw_.append(std::move(node));
    }
    current_[mutated] = result;
    changed_ = true;
  }

  Graph& g_;
  GraphRewriter rw_;
  std::vector<ValueId> current_;
  std::unordered_map<ValueId, int64_t> viewed_until_;  // the last read of any view made of each value so far
  std::vector<int32_t> readers_;  // nodes (and graph outputs) reading each value of the graph as given
  std::vector<int64_t> last_read_;  // alias_last_read of the graph as given
  bool changed_ = false;
};

// Writes through slices, selects and aliases of a fresh tensor (`out = torch.empty(n, m); out[:, :k] = a`, circular
// padding's copies): the in-place op on the view becomes its functional twin, and the result is scattered back into
// the base through slice_scatter / select_scatter (an alias's result is the base's), level by level, giving the base's
// next value. Later reads of the base read that value; later reads of any slice or select of it made before are made
// again from it. A write is left in place while some other view of the base (a reshape, a transpose) made before it
// is read after it: that view would not see the new values.
// A graph input that needs no grad (a buffer: `self.counts[0] += 1`, spectral norm's `u`) is a root too, unless a
// graph output shares its storage (eager's output would alias the buffer): its last value is copied into it at the
// end (`copy_`), which functionalize_buffer_updates turns into a write-back after the graph.
class ViewWrites {
 public:
  explicit ViewWrites(Graph& g)
      : g_(g), rw_(g), current_(g.values.size()), readers_(count_readers(g)), last_read_(alias_last_read(g)) {
    for (size_t v = 0; v < current_.size(); ++v) current_[v] = static_cast<ValueId>(v);
    find_buffer_inputs();
  }

  bool run() {
    std::vector<Node> nodes = rw_.take_nodes();
    for (Node& node : nodes) {
      for (ArgValue& arg : node.args) graph::remap_tensors(arg, [&](ValueId id) { return read(id); });
      if (node.is_view) track_view(node);
      if (node.mutates_args && write_through(node)) {
        ++position_;
        continue;
      }
      rw_.append(std::move(node));
      ++position_;
    }
    for (ValueId& out : g_.outputs) out = read(out);
    for (ValueId input : g_.inputs) {
      if (!buffers_.count(input) || current_[input] == input) continue;
      graph::TensorMeta meta = g_.values[input].meta;
      // Values that need grad written into a buffer make it need grad, as eager's copy_ does: left in place (the
      // interpreter runs it).
      meta.requires_grad = g_.values[current_[input]].meta.requires_grad;
      rw_.add("aten::copy_", "default", {TensorArg{input}, TensorArg{current_[input]}, false},
              {"self", "src", "non_blocking"}, 3, meta);
      g_.nodes.back().mutates_args = true;
    }
    return changed_;
  }

 private:
  struct Tracked {
    ValueId root;             // the fresh tensor the views start from (its original id)
    std::vector<Node> chain;  // slice / select nodes from the root to this view
    int version;              // the root's version the view was last made from
  };

  static bool writable_view(const Node& node) {
    const std::string name = node.qualified_name();
    // alias: the whole tensor (`out[:, :n]` with n its full size, GhostNet's `x += shortcut` on it)
    return (name == "aten::slice.Tensor" || name == "aten::select.int" || name == "aten::alias.default") &&
           node.outputs.size() == 1 &&
           !node.args.empty() && std::holds_alternative<TensorArg>(node.args[0]);
  }

  // The current value for original value `id`: renamed, and a tracked view made again when its root has changed.
  ValueId read(ValueId id) {
    auto it = tracked_.find(id);
    if (it != tracked_.end() && it->second.version != version_[it->second.root]) {
      ValueId value = current_[it->second.root];
      for (const Node& view : it->second.chain) value = replay(view, value, g_.values[view.outputs[0]].meta);
      current_[id] = value;
      it->second.version = version_[it->second.root];
    }
    return current_[id];
  }

  ValueId replay(const Node& view, ValueId base, graph::TensorMeta meta) {
    std::vector<ArgValue> args = view.args;
    args[0] = TensorArg{base};
    meta.requires_grad = g_.values[base].meta.requires_grad;
    changed_ = true;
    return rw_.add(view.op, view.overload, std::move(args), view.arg_names, view.num_positional, meta, true);
  }

  void track_view(const Node& node) {
    // The node's base is already renamed: find the original id it stands for.
    const auto* base = node.args.empty() ? nullptr : std::get_if<TensorArg>(&node.args[0]);
    if (!base) return;
    const ValueId b = original_of(base->id);
    std::optional<ValueId> root;
    std::vector<Node> chain;
    if (auto t = tracked_.find(b); t != tracked_.end()) {
      root = t->second.root;
      chain = t->second.chain;
    } else if (made_here(g_, readers_, b) || buffers_.count(b)) {  // producers already appended: g_.nodes holds them
      root = b;
      roots_.insert(b);
    }
    if (!root) return;
    if (!writable_view(node)) {
      int64_t& until = tainted_until_[*root];
      for (ValueId out : node.outputs) until = std::max(until, last_read_[out]);
      return;
    }
    chain.push_back(node);
    tracked_[node.outputs[0]] = Tracked{*root, std::move(chain), version_[*root]};
  }

  // Some other view of `root` (a reshape, a transpose) is read after the write at this position: it would see the
  // new values, which the functional form cannot give it.
  bool tainted(ValueId root) const {
    auto it = tainted_until_.find(root);
    return it != tainted_until_.end() && it->second > position_;
  }

  ValueId original_of(ValueId current) const {
    auto it = original_.find(current);
    return it == original_.end() ? current : it->second;
  }

  bool write_through(Node& node) {
    const auto* self = node.args.empty() ? nullptr : std::get_if<TensorArg>(&node.args[0]);
    if (!self || is_inplace_view(graph::op_facts(node.qualified_name()))) return false;
    auto t = tracked_.find(original_of(self->id));
    if (t == tracked_.end()) return write_root(node, original_of(self->id));
    if (tainted(t->second.root)) return false;
    const Tracked tracked = t->second;
    if (!make_functional(g_, node, nullptr)) return false;
    const ValueId written = node.outputs[0];  // the functional result: the view's new values
    rw_.append(std::move(node));
    // The chain's levels from the current root, then the written values scattered back from the innermost.
    std::vector<ValueId> levels = {current_[tracked.root]};
    for (size_t i = 0; i + 1 < tracked.chain.size(); ++i)
      levels.push_back(replay(tracked.chain[i], levels.back(), g_.values[tracked.chain[i].outputs[0]].meta));
    ValueId src = written;
    for (size_t i = tracked.chain.size(); i-- > 0;) src = scatter(tracked.chain[i], levels[i], src);
    current_[tracked.root] = src;
    original_[src] = tracked.root;
    ++version_[tracked.root];
    // The in-place op's result aliased the view: reading it later reads the view made again.
    tracked_[written] = Tracked{tracked.root, tracked.chain, -1};
    changed_ = true;
    return true;
  }

  // An in-place op on a root itself, after writes through its views (BART's shift_tokens_right: `out[:, 1:] = ...`,
  // `out[:, 0] = ...`, then `out.masked_fill_(...)`): the functional op's result is the root's next value, from which
  // its views are made again when read.
  bool write_root(Node& node, ValueId root) {
    if (!roots_.count(root) || tainted(root)) return false;
    if (!make_functional(g_, node, nullptr)) return false;
    const ValueId written = node.outputs[0];
    rw_.append(std::move(node));
    current_[root] = written;
    original_[written] = root;
    ++version_[root];
    changed_ = true;
    return true;
  }

  // Inputs that need no grad, dense and contiguous from offset 0, whose storage no graph output shares (through
  // views and in-place results) and that no other op writes except through tracked views (checked as they come).
  void find_buffer_inputs() {
    std::unordered_map<ValueId, ValueId> storage_of;
    for (ValueId id : g_.inputs) {
      const graph::TensorMeta& meta = g_.values[id].meta;
      if (meta.requires_grad || meta.storage_offset != 0 || meta.strides != graph::contiguous_strides(meta.sizes))
        continue;
      storage_of[id] = id;
    }
    for (const Node& node : g_.nodes) {
      if (!node.is_view && !node.mutates_args) continue;
      const auto* base = node.args.empty() ? nullptr : std::get_if<TensorArg>(&node.args[0]);
      auto it = base ? storage_of.find(base->id) : storage_of.end();
      if (it == storage_of.end()) continue;
      for (ValueId out : node.outputs) storage_of[out] = it->second;
    }
    std::unordered_set<ValueId> escaping;
    for (ValueId out : g_.outputs)
      if (auto it = storage_of.find(out); it != storage_of.end()) escaping.insert(it->second);
    for (const auto& [value, input] : storage_of)
      if (value == input && !escaping.count(input)) buffers_.insert(input);
  }

  ValueId scatter(const Node& view, ValueId base, ValueId src) {
    if (view.qualified_name() == "aten::alias.default") return src;  // the written values are the whole base
    graph::TensorMeta meta = g_.values[base].meta;
    meta.requires_grad = meta.requires_grad || g_.values[src].meta.requires_grad;
    std::vector<ArgValue> args = {TensorArg{base}, TensorArg{src}};
    args.insert(args.end(), view.args.begin() + 1, view.args.end());
    if (view.qualified_name() == "aten::slice.Tensor")
      return rw_.add("aten::slice_scatter", "default", std::move(args), {"self", "src", "dim", "start", "end", "step"}, 6, meta);
    return rw_.add("aten::select_scatter", "default", std::move(args), {"self", "src", "dim", "index"}, 4, meta);
  }

  Graph& g_;
  GraphRewriter rw_;
  std::vector<ValueId> current_;  // by original value id
  std::vector<int32_t> readers_;
  std::unordered_map<ValueId, Tracked> tracked_;    // by original (or written) value id
  std::unordered_map<ValueId, ValueId> original_;   // a root's new value -> the root's original id
  std::unordered_map<ValueId, int> version_;
  std::unordered_map<ValueId, int64_t> tainted_until_;  // roots some other view aliases: that view's last read
  std::vector<int64_t> last_read_;                       // alias_last_read of the graph as given
  int64_t position_ = 0;                                 // the index of the node being rewritten, as given
  std::unordered_set<ValueId> roots_;    // fresh tensors (and buffers) some slice or select was taken of
  std::unordered_set<ValueId> buffers_;  // inputs that may be roots (find_buffer_inputs)
  bool changed_ = false;
};

}  // namespace

bool functionalize_inplace_ops(Graph& g) {
  const bool changed = Functionalize(g).run();
  return ViewWrites(g).run() || changed;
}

}  // namespace kiln::passes
