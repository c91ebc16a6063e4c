// propagate_symbolic_sizes: symbolic metas for a recorded graph, from its marked input dims and kiln's shape rules.
//
// Design note: the recorder gives every value a concrete meta (these rules at the captured sizes, else torch's meta
// kernels); this pass adds the symbolic one next to it and checks the two agree at the hints, node by node.
// Where the rules cannot follow (no rule, a refusal), the symbols the node reads are pinned to their hints: the graph
// is then specialised in them everywhere, never wrong. One substitution map carries what the graph learned about
// symbols (s1 -> s0 from an assumed equality, s0 -> 8 from a pin); each node's arguments go through it before its
// rule runs, and every stored meta once more at the end.
//
// The tracer's placeholders enter the same map: each is bound to its value's size expression as soon as that value's
// meta is known (inputs and constants first, then each node's outputs after its rule), and a trace assumption is
// handled like a rule's once every placeholder it names is bound. Values are defined before they are read, so a
// node's int arguments never name a placeholder still unbound.
#include "graph/propagate_symbolic_sizes.h"

#include <algorithm>
#include <map>
#include <set>
#include <numeric>

#include "common/error.h"
#include "graph/infer_recorded_sizes.h"

namespace kiln::graph {

using shape::SymTensorMeta;
using sym::Expr;

namespace {

// Strides over symbolic `sizes` for an input whose concrete strides are dense in some dim order (row-major,
// channels-last, transposed); the concrete strides otherwise.
std::vector<Expr> input_strides(const std::vector<Expr>& sizes, const TensorMeta& meta) {
  std::vector<Expr> constant(meta.strides.begin(), meta.strides.end());
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  // Innermost first; equal strides (dims of size 1) keep row-major order: the later dim is the inner one.
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return meta.strides[a] != meta.strides[b] ? meta.strides[a] < meta.strides[b] : a > b;
  });
  std::vector<Expr> strides(sizes.size());
  Expr running = 1;
  int64_t running_hint = 1;
  for (size_t d : order) {
    if (meta.strides[d] != running_hint) return constant;
    strides[d] = running;
    running = running * (meta.sizes[d] == 0 ? Expr(1) : sizes[d]);  // (c10 counts a size 0 as 1)
    running_hint *= std::max<int64_t>(meta.sizes[d], 1);
  }
  return strides;
}

bool is_symbolic(const SymTensorMeta& m) {
  auto symbolic = [](const Expr& e) { return !e.is_constant(); };
  return std::any_of(m.sizes.begin(), m.sizes.end(), symbolic) ||
         std::any_of(m.strides.begin(), m.strides.end(), symbolic) || symbolic(m.storage_offset);
}

std::string node_name(const Graph& g, NodeIndex n) {
  return "node " + std::to_string(n) + " (" + g.nodes[n].qualified_name() + ")";
}

class Propagation {
 public:
  explicit Propagation(Graph& g) : g_(g), s_(mutable_symbolic(g)), hints_(s_.hints()) {
    s_.metas.resize(g.values.size());
    for (const SymbolicIntArg& a : s_.int_args) int_args_[{a.node, a.arg}].push_back(a);
    for (const auto& [node, arg] : s_.size_args) size_args_[node].push_back(arg);
    for (size_t i = 0; i < s_.placeholders.size(); ++i)
      placeholders_of_[s_.placeholders[i].value].push_back(i);
    pending_ = std::move(s_.trace_assumptions);
    s_.trace_assumptions.clear();
  }

  void run() {
    for (const Value& v : g_.values)
      if (v.producer < 0) bind_placeholders(v.id);
    take_trace_assumptions();
    for (NodeIndex n = 0; n < static_cast<NodeIndex>(g_.nodes.size()); ++n) {
      visit(n);
      for (ValueId out : g_.nodes[n].outputs) bind_placeholders(out);
      take_trace_assumptions();
    }
    KILN_ASSERT(pending_.empty()) << "a trace assumption (" << pending_[0].to_string() << ") names a placeholder "
                                  << "no value defines";
    for (auto& m : s_.metas)
      if (m) m = finish(*m);
    for (SizePlaceholder& p : s_.placeholders) p.resolved = apply(p.symbol);
    // The int arguments over the symbols as they end; inferred ones that became constants say nothing.
    std::vector<SymbolicIntArg> int_args;
    for (SymbolicIntArg a : s_.int_args) {
      a.value = apply(a.value);
      int_args.push_back(std::move(a));
    }
    for (SymbolicIntArg& a : inferred_) {
      a.value = apply(a.value);
      if (!a.value.is_constant()) int_args.push_back(std::move(a));
    }
    s_.int_args = std::move(int_args);
  }

 private:
  Expr apply(const Expr& e) const { return s_.facts.simplify(subst_.empty() ? e : e.substitute(subst_)); }

  SymTensorMeta apply(SymTensorMeta m) const {
    for (Expr& e : m.sizes) e = apply(e);
    for (Expr& e : m.strides) e = apply(e);
    m.storage_offset = apply(m.storage_offset);
    return m;
  }

  std::optional<SymTensorMeta> finish(const SymTensorMeta& m) const {
    SymTensorMeta out = apply(m);
    if (!is_symbolic(out)) return std::nullopt;
    return out;
  }

  // The meta of tensor `id` as the rules see it, noting the symbols it names.
  SymTensorMeta tensor(ValueId id, std::vector<Expr>& read) const {
    const SymTensorMeta* m = s_.meta(id);
    if (!m) return constant_meta(g_.value(id).meta);
    SymTensorMeta out = apply(*m);
    auto note = [&](const Expr& e) {
      for (const Expr& s : e.free_symbols()) read.push_back(s);
    };
    for (const Expr& e : out.sizes) note(e);
    for (const Expr& e : out.strides) note(e);
    note(out.storage_offset);
    return out;
  }

  // The marked int argument `element` of node n's argument `arg` (over the symbols as they are now), if any.
  std::optional<Expr> marked_int(NodeIndex n, size_t arg, int32_t element) const {
    auto marked = int_args_.find({n, static_cast<int32_t>(arg)});
    if (marked == int_args_.end()) return std::nullopt;
    for (const SymbolicIntArg& s : marked->second)
      if (s.element == element) {
        Expr e = apply(s.value);
        for (const Expr& symbol : e.free_symbols())
          KILN_ASSERT(!is_size_placeholder(symbol))
              << node_name(g_, n) << " reads placeholder " << symbol.to_string() << " before its value is defined";
        return e;
      }
    return std::nullopt;
  }

  // Node n's arguments in the rules' form; nullopt for one the rules have no form for (a complex number).
  std::optional<std::vector<shape::RuleArg>> rule_args(NodeIndex n, std::vector<Expr>& read) const {
    return shape::rule_args(
        g_.nodes[n].args, [&](ValueId id) { return tensor(id, read); },
        [&](size_t arg, int32_t element, int64_t value) -> Expr {
          std::optional<Expr> e = marked_int(n, arg, element);
          if (!e) return value;
          for (const Expr& symbol : e->free_symbols()) read.push_back(symbol);
          return *e;
        });
  }

  void visit(NodeIndex n) {
    const Node& node = g_.nodes[n];
    std::vector<Expr> read;
    std::optional<std::vector<shape::RuleArg>> args = rule_args(n, read);
    if (read.empty() && !(args && broadcasts_to_a_symbol(n, *args))) return;  // no symbol reaches it: concrete
    const std::string op = node.qualified_name();
    if (!args) {
      specialise(read, node_name(g_, n) + ": a complex argument has no symbolic form");
      return;
    }
    if (std::optional<std::string> computed = computed_size_argument(n)) {
      specialise(read, node_name(g_, n) + ": its " + *computed +
                           " was computed inside an op recorded whole, from sizes kiln does not follow");
      return;
    }
    infer_sizes(n, *args);
    if (std::optional<std::string> left = infer_scalar_sizes(n, *args)) {
      specialise(read, node_name(g_, n) + ": its " + *left +
                           " was computed inside an op recorded whole, and no symbolic form explains it");
      return;
    }
    if (std::optional<std::string> left = uninferred_size_argument(n, *args)) {
      specialise(read, node_name(g_, n) + ": its " + *left +
                           " was computed inside an op recorded whole, and no symbolic form explains it");
      return;
    }
    shape::RuleResult result = shape::infer_shapes(op, *args, s_.facts, &hints_);
    if (!result.has_rule) {
      specialise(read, node_name(g_, n) + ": " + result.reason);
      return;
    }
    std::vector<const SymTensorMeta*> outputs;
    for (const auto& out : result.outputs)
      if (out) outputs.push_back(&*out);
    KILN_ASSERT_EQ(outputs.size(), node.outputs.size())
        << "the shape rule of " << op << " (node " << n << ") gives a different number of tensor outputs";
    for (size_t i = 0; i < outputs.size(); ++i) check(n, *outputs[i], node.outputs[i]);
    for (size_t i = 0; i < outputs.size(); ++i) s_.metas[node.outputs[i]] = finish(*outputs[i]);
    for (shape::Assumption& a : result.assumptions) {
      a.reason = node_name(g_, n) + ": " + a.reason;
      s_.assumptions.push_back(a);
      if (a.kind == shape::Assumption::Kind::kEq) unify(a);
    }
  }

  // -1, 0, 1 and the end-of-dim sentinel are the defaults ATen's indexing fills in (x[:, :n] is slice(x, 1, 0, n, 1)),
  // not sizes of 2 or more that symbols stand for.
  static bool computed(int64_t v) { return (v >= 2 || v < -1) && v < (int64_t{1} << 62); }

  // The name of a size argument of node n (add_size_argument) holding an int no tracer marked, outside the
  // configuration sizes and the size lists infer_sizes covers; nullopt when there is none. A select's index counts as
  // configuration: composites pick items by literal positions (multi-head attention's packed q, k, v).
  std::optional<std::string> computed_size_argument(NodeIndex n) const {
    auto found = size_args_.find(n);
    if (found == size_args_.end()) return std::nullopt;
    const Node& node = g_.nodes[n];
    static const std::set<std::string> configuration = {"stride",     "padding",       "dilation",     "groups",
                                                        "output_padding", "normalized_shape", "padding_idx",
                                                        "ignore_index", "diagonal", "index"};
    const std::optional<RecordedSizeArgs> inferable = recorded_size_args(node.qualified_name());
    const ScalarSizeForms* scalars = scalar_size_forms(node.qualified_name());
    auto has_form = [&](int32_t a) {
      return scalars && std::any_of(scalars->forms.begin(), scalars->forms.end(), [&](const auto& f) { return f.first == a; });
    };
    for (int32_t a : found->second) {
      const std::string name = static_cast<size_t>(a) < node.arg_names.size() ? node.arg_names[a] : "";
      if (configuration.count(name) || (inferable && inferable->sizes == a) || has_form(a)) continue;
      if (const auto* i = std::get_if<int64_t>(&node.args[a]); i && computed(*i) && !marked_int(n, a, -1))
        return "argument " + name;
      if (const auto* list = std::get_if<std::vector<int64_t>>(&node.args[a]))
        for (size_t e = 0; e < list->size(); ++e)
          if (computed((*list)[e]) && !marked_int(n, a, static_cast<int32_t>(e))) return "argument " + name;
    }
    return std::nullopt;
  }

  // Node n's single int size arguments that have a form over its tensor's sizes (scalar_size_forms) take that form
  // where it evaluates to the recorded int at the hints, and are remembered as symbolic int arguments. The name of
  // one that no form explains (and no tracer marked), or nullopt.
  std::optional<std::string> infer_scalar_sizes(NodeIndex n, std::vector<shape::RuleArg>& args) {
    const Node& node = g_.nodes[n];
    const ScalarSizeForms* scalars = scalar_size_forms(node.qualified_name());
    if (!scalars || static_cast<size_t>(scalars->tensor) >= args.size()) return std::nullopt;
    const auto* input = std::get_if<SymTensorMeta>(&args[scalars->tensor]);
    if (!input) return std::nullopt;
    for (const auto& [a, form] : scalars->forms) {
      const auto* recorded = static_cast<size_t>(a) < node.args.size() ? std::get_if<int64_t>(&node.args[a]) : nullptr;
      if (!recorded || marked_int(n, a, -1)) continue;
      const Expr e = apply(form(input->sizes));
      if (e.evaluate(hints_) == *recorded) {
        args[a] = e;
        if (!e.is_constant()) inferred_.push_back({n, a, -1, e});
      } else if (computed(*recorded)) {
        return "argument " + node.arg_names[a];
      }
    }
    return std::nullopt;
  }

  // For an op whose rule does not check its inferred size list (upsampling): the argument's name when an entry that
  // a composite computed is still concrete after infer_sizes; nullopt otherwise.
  std::optional<std::string> uninferred_size_argument(NodeIndex n, const std::vector<shape::RuleArg>& args) const {
    const Node& node = g_.nodes[n];
    const std::optional<RecordedSizeArgs> which = recorded_size_args(node.qualified_name());
    if (!which || which->checked_by_rule || static_cast<size_t>(which->sizes) >= args.size()) return std::nullopt;
    const auto* sizes = std::get_if<std::vector<Expr>>(&args[which->sizes]);
    const auto* recorded = std::get_if<std::vector<int64_t>>(&node.args[which->sizes]);
    if (!sizes || !recorded || sizes->size() != recorded->size()) return std::nullopt;
    for (size_t k = 0; k < sizes->size(); ++k)
      if ((*sizes)[k].is_constant() && computed((*recorded)[k]) && !marked_int(n, which->sizes, static_cast<int32_t>(k)))
        return "argument " + node.arg_names[which->sizes];
    return std::nullopt;
  }

  // Whether node n is an expand of a concrete tensor whose recorded sizes broadcast a dim to a symbol's size (matmul's
  // batch broadcast of a weight inside a composite): then its output is symbolic although no symbol reaches it.
  bool broadcasts_to_a_symbol(NodeIndex n, std::vector<shape::RuleArg> args) {
    if (g_.nodes[n].qualified_name() != "aten::expand.default") return false;
    const auto* before = args.size() > 1 ? std::get_if<std::vector<Expr>>(&args[1]) : nullptr;
    if (!before) return false;
    const std::vector<Expr> recorded = *before;
    infer_sizes(n, args, /*remember=*/false);
    const auto* after = std::get_if<std::vector<Expr>>(&args[1]);
    return after && *after != recorded;
  }

  // The forms of the sizes a composite computed into node n's size list (graph/infer_recorded_sizes.h), put in its
  // rule arguments and remembered as symbolic int arguments.
  void infer_sizes(NodeIndex n, std::vector<shape::RuleArg>& args, bool remember = true) {
    const Node& node = g_.nodes[n];
    std::optional<RecordedSizeArgs> which = recorded_size_args(node.qualified_name());
    if (!which || node.outputs.size() != 1 || static_cast<size_t>(which->sizes) >= args.size()) return;
    const auto* input = std::get_if<SymTensorMeta>(&args[which->tensor]);
    auto* sizes = std::get_if<std::vector<Expr>>(&args[which->sizes]);
    const auto* recorded = std::get_if<std::vector<int64_t>>(&node.args[which->sizes]);
    const auto* tensor = std::get_if<TensorArg>(&node.args[which->tensor]);
    if (!input || !sizes || !recorded || !tensor) return;
    if (std::all_of(input->sizes.begin(), input->sizes.end(), [](const Expr& e) { return e.is_constant(); }) &&
        node.qualified_name() != "aten::expand.default")
      return;  // (an expand of a concrete tensor may still broadcast it to a symbolic size: expand_sizes)
    RecordedSizes r;
    r.input = input;
    r.input_hints = g_.value(tensor->id).meta.sizes;
    r.sizes = *sizes;
    for (size_t k = 0; k < sizes->size(); ++k)
      r.inferable.push_back(!marked_int(n, which->sizes, static_cast<int32_t>(k)));
    r.output_hints = g_.value(node.outputs[0]).meta.sizes;
    if (!which->checked_by_rule && r.output_hints.size() >= sizes->size())  // upsampling: the trailing (spatial) dims
      r.output_hints.erase(r.output_hints.begin(), r.output_hints.end() - static_cast<std::ptrdiff_t>(sizes->size()));
    r.hints = &hints_;
    for (size_t a = 0; a < node.arg_names.size(); ++a) {
      const std::string& name = node.arg_names[a];
      if (name != "scales_h" && name != "scales_w" && name != "scales_d" && name != "scales") continue;
      const double* scale = std::get_if<double>(&node.args[a]);
      r.scales.push_back(scale ? std::optional<double>(*scale) : std::nullopt);
    }
    std::vector<Expr> inferred = infer_recorded_sizes(node.qualified_name(), r);
    for (size_t k = 0; k < inferred.size() && remember; ++k)
      if (inferred[k] != (*sizes)[k]) inferred_.push_back({n, which->sizes, static_cast<int32_t>(k), inferred[k]});
    *sizes = std::move(inferred);
  }

  // Binds the placeholders of value `id` to its sizes, now that its meta is known.
  void bind_placeholders(ValueId id) {
    auto it = placeholders_of_.find(id);
    if (it == placeholders_of_.end()) return;
    const SymTensorMeta* m = s_.meta(id);
    const SymTensorMeta meta = m ? apply(*m) : constant_meta(g_.value(id).meta);
    for (size_t i : it->second) {
      const SizePlaceholder& p = s_.placeholders[i];
      bind(p.symbol, meta.sizes.at(p.dim));
    }
  }

  // Moves each trace assumption whose placeholders are all bound into the assumptions, as a rule's would be.
  void take_trace_assumptions() {
    std::vector<shape::Assumption> waiting;
    for (shape::Assumption& a : pending_) {
      a.lhs = apply(a.lhs);
      a.rhs = apply(a.rhs);
      bool ready = true;
      for (const Expr& e : {a.lhs, a.rhs})
        for (const Expr& symbol : e.free_symbols()) ready = ready && !is_size_placeholder(symbol);
      if (!ready) {
        waiting.push_back(std::move(a));
        continue;
      }
      if (a.lhs.is_constant() && a.rhs.is_constant()) {
        KILN_ASSERT(a.holds({})) << "trace assumption " << a.to_string() << " (" << a.reason << ") is false";
        continue;
      }
      shape::record_assumption_in_facts(a, s_.facts);
      s_.assumptions.push_back(a);
      if (a.kind == shape::Assumption::Kind::kEq) unify(a);
    }
    pending_ = std::move(waiting);
  }

  // A rule's output evaluated at the hints must be the recorded meta exactly.
  void check(NodeIndex n, const SymTensorMeta& out, ValueId id) const {
    const TensorMeta& recorded = g_.value(id).meta;
    TensorMeta at_hints = recorded;
    at_hints.sizes.clear();
    at_hints.strides.clear();
    for (const Expr& e : out.sizes) at_hints.sizes.push_back(e.evaluate(hints_));
    for (const Expr& e : out.strides) at_hints.strides.push_back(e.evaluate(hints_));
    at_hints.storage_offset = out.storage_offset.evaluate(hints_);
    at_hints.dtype = out.dtype;
    KILN_ASSERT(at_hints.sizes == recorded.sizes && at_hints.strides == recorded.strides &&
                at_hints.storage_offset == recorded.storage_offset && at_hints.dtype == recorded.dtype)
        << "the shape rule of " << g_.nodes[n].qualified_name() << " (node " << n << ", output %" << id << ") gives "
        << out.to_string() << " = " << meta_to_string(at_hints) << " at the hints, but the recorded meta is "
        << meta_to_string(recorded);
  }

  // Replaces `symbol` by `e` everywhere from now on (and in what the map already holds).
  void bind(const Expr& symbol, const Expr& e) {
    sym::Substitution one = {{symbol.symbol_id(), e}};
    for (auto& [id, value] : subst_) value = value.substitute(one);
    subst_[symbol.symbol_id()] = e;
  }

  void pin(const Expr& symbol, const std::string& reason) {
    const int64_t hint = hints_.at(symbol.symbol_id());
    bind(symbol, hint);
    s_.facts.set_range(symbol, {hint, hint});
    s_.specialisations.push_back({symbol, hint, reason});
  }

  void specialise(const std::vector<Expr>& read, const std::string& reason) {
    for (const Expr& symbol : read)
      if (!apply(symbol).is_constant()) pin(symbol, reason);
  }

  // An assumed equality that names a symbol on one side: the symbol becomes the other side (the lower id of two
  // symbols survives); with a constant, that pins it. Other equalities are solved for a symbol where they are linear
  // in it with a unit coefficient once common factors go (bmm's `s0*4 == s2*4` makes s2 s0).
  void unify(const shape::Assumption& a) {
    Expr lhs = apply(a.lhs), rhs = apply(a.rhs);
    if (lhs == rhs) return;
    if (lhs.is_symbol() && rhs.is_symbol()) {
      if (lhs.symbol_id() < rhs.symbol_id()) std::swap(lhs, rhs);
      merge_facts(lhs, rhs);
      bind(lhs, rhs);
      return;
    }
    if (!lhs.is_symbol()) std::swap(lhs, rhs);
    if (!lhs.is_symbol() && !solve(lhs - rhs, lhs, rhs)) return;
    for (const Expr& s : rhs.free_symbols())
      if (s == lhs) return;
    if (rhs.is_constant()) {
      pin(lhs, a.reason + " (" + a.to_string() + ")");
      return;
    }
    if (rhs.is_symbol()) merge_facts(lhs, rhs);
    bind(lhs, rhs);
  }

  // difference == 0 as symbol == value: the symbol of highest id whose term is g*symbol, g the gcd of every
  // coefficient and the constant, and that no other term names. False when there is none.
  static bool solve(const Expr& difference, Expr& symbol, Expr& value) {
    if (difference.kind() != sym::ExprKind::kSum) return false;
    int64_t g = std::gcd(difference.sum_constant(), int64_t{0});
    for (const Expr::Term& t : difference.terms()) g = std::gcd(g, t.coefficient);
    const Expr::Term* chosen = nullptr;
    for (const Expr::Term& t : difference.terms()) {
      if (t.factors.size() != 1 || t.factors[0].exponent != 1 || !t.factors[0].atom.is_symbol() ||
          (t.coefficient != g && t.coefficient != -g))
        continue;
      if (chosen && chosen->factors[0].atom.symbol_id() > t.factors[0].atom.symbol_id()) continue;
      chosen = &t;
    }
    if (!chosen) return false;
    // symbol = -(the other terms) / its coefficient, exactly.
    Expr rest = -difference.sum_constant() / chosen->coefficient;
    for (const Expr::Term& t : difference.terms()) {
      if (&t == chosen) continue;
      Expr term = -t.coefficient / chosen->coefficient;
      for (const Expr::Factor& f : t.factors)
        for (int64_t k = 0; k < f.exponent; ++k) term = term * f.atom;
      rest = rest + term;
    }
    symbol = chosen->factors[0].atom;
    value = rest;
    return true;
  }

  // What was known of `from` now holds of `to`.
  void merge_facts(const Expr& from, const Expr& to) {
    sym::Range a = s_.facts.range(from.symbol_id()), b = s_.facts.range(to.symbol_id());
    s_.facts.set_range(to, {std::max(a.lo, b.lo), std::min(a.hi, b.hi)});
    s_.facts.add_divisor(to, s_.facts.divisor(from.symbol_id()));
  }

  Graph& g_;
  SymbolicSizes& s_;
  sym::Bindings hints_;
  sym::Substitution subst_;
  std::map<std::pair<NodeIndex, int32_t>, std::vector<SymbolicIntArg>> int_args_;
  std::map<NodeIndex, std::vector<int32_t>> size_args_;
  std::vector<SymbolicIntArg> inferred_;  // int arguments infer_sizes found
  std::map<ValueId, std::vector<size_t>> placeholders_of_;  // value -> indices into s_.placeholders
  std::vector<shape::Assumption> pending_;  // trace assumptions naming placeholders not bound yet
};

}  // namespace

namespace {

// Dim d of input `input_index` (negative counts from the end), which must exist.
int64_t input_dim(const Graph& g, int32_t input_index, int64_t d) {
  KILN_CHECK(input_index >= 0 && static_cast<size_t>(input_index) < g.inputs.size())
      << "the graph has " << g.inputs.size() << " inputs, no input " << input_index;
  const TensorMeta& meta = g.value(g.inputs[input_index]).meta;
  const int64_t ndim = static_cast<int64_t>(meta.sizes.size());
  KILN_CHECK(d >= -ndim && d < ndim) << "input " << input_index << " " << meta_to_string(meta) << " has no dim " << d;
  return d < 0 ? d + ndim : d;
}

// Makes each symbol the size of its dim of input `input_index` (dims wrapped, sizes >= 2, not symbolic yet).
void set_input_symbols(Graph& g, int32_t input_index, const std::vector<std::pair<int64_t, Expr>>& symbols) {
  const ValueId id = g.inputs[input_index];
  const TensorMeta& meta = g.value(id).meta;
  SymbolicSizes& s = mutable_symbolic(g);
  s.metas.resize(std::max(s.metas.size(), g.values.size()));
  SymTensorMeta m = symbolic_meta(g, id);
  for (const auto& [d, symbol] : symbols) {
    s.symbols.push_back({symbol, input_index, static_cast<int32_t>(d), meta.sizes[d]});
    m.sizes[d] = symbol;
  }
  m.strides = input_strides(m.sizes, meta);
  s.metas[id] = m;
}

}  // namespace

std::vector<Expr> mark_symbolic_dims(Graph& g, int32_t input_index, const std::vector<int64_t>& dims) {
  std::vector<int64_t> wanted;
  for (int64_t d : dims) {
    d = input_dim(g, input_index, d);
    // Sizes 0 and 1 stay concrete, and a dim marked twice keeps its symbol.
    const ValueId id = g.inputs[input_index];
    if (g.value(id).meta.sizes[d] >= 2 && symbolic_meta(g, id).sizes[d].is_constant() &&
        std::find(wanted.begin(), wanted.end(), d) == wanted.end())
      wanted.push_back(d);
  }
  if (wanted.empty()) return {};
  SymbolicSizes& s = mutable_symbolic(g);
  std::vector<std::pair<int64_t, Expr>> symbols;
  std::vector<Expr> made;
  for (int64_t d : wanted) {
    symbols.emplace_back(d, s.facts.new_symbol());
    made.push_back(symbols.back().second);
  }
  set_input_symbols(g, input_index, symbols);
  return made;
}

void mark_symbolic_dims(Graph& g, int32_t input_index, const std::vector<int64_t>& dims,
                        const std::vector<Expr>& symbols) {
  KILN_CHECK(dims.size() == symbols.size()) << dims.size() << " dims and " << symbols.size() << " symbols";
  std::vector<std::pair<int64_t, Expr>> given;
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = input_dim(g, input_index, dims[i]);
    const Expr& symbol = symbols[i];
    const ValueId id = g.inputs[input_index];
    KILN_CHECK(symbol.is_symbol() && !is_size_placeholder(symbol) && symbol.symbol_id() >= 0)
        << symbol.to_string() << " is not an input size symbol (input_size_symbol)";
    KILN_CHECK(g.value(id).meta.sizes[d] >= 2)
        << "dim " << d << " of input " << input_index << " has size " << g.value(id).meta.sizes[d]
        << ": sizes 0 and 1 stay concrete, make no symbol for them";
    KILN_CHECK(symbolic_meta(g, id).sizes[d].is_constant())
        << "dim " << d << " of input " << input_index << " is symbolic already";
    bool used = g.symbolic && g.symbolic->origin(symbol.symbol_id());
    for (const auto& [other_dim, other] : given) {
      used = used || other.symbol_id() == symbol.symbol_id();
      KILN_CHECK(other_dim != d) << "dim " << d << " of input " << input_index << " is listed twice";
    }
    KILN_CHECK(!used) << "symbol " << symbol.to_string() << " stands for another dim already";
    given.emplace_back(d, symbol);
  }
  if (given.empty()) return;
  SymbolicSizes& s = mutable_symbolic(g);
  for (const auto& [d, symbol] : given) s.facts.set_range(symbol, sym::SizeFacts::kDynamicSizeRange);
  set_input_symbols(g, input_index, given);
}

void add_size_placeholder(Graph& g, SizePlaceholder placeholder) {
  KILN_CHECK(is_size_placeholder(placeholder.symbol))
      << placeholder.symbol.to_string() << " is not a size placeholder (size_placeholder_symbol)";
  KILN_CHECK(!g.symbolic || !g.symbolic->placeholder(placeholder.symbol.symbol_id()))
      << "placeholder " << placeholder.symbol.to_string() << " is added twice";
  KILN_CHECK(placeholder.value >= 0 && static_cast<size_t>(placeholder.value) < g.values.size())
      << "the graph has no value %" << placeholder.value;
  const TensorMeta& meta = g.values[placeholder.value].meta;
  const int32_t ndim = static_cast<int32_t>(meta.sizes.size());
  KILN_CHECK(placeholder.dim >= -ndim && placeholder.dim < ndim)
      << "value %" << placeholder.value << " " << meta_to_string(meta) << " has no dim " << placeholder.dim;
  if (placeholder.dim < 0) placeholder.dim += ndim;
  placeholder.resolved.reset();
  mutable_symbolic(g).placeholders.push_back(std::move(placeholder));
}

void add_trace_assumption(Graph& g, shape::Assumption assumption) {
  const sym::Bindings known = g.symbolic ? g.symbolic->hints_with_placeholders(g) : sym::Bindings{};
  for (const Expr& side : {assumption.lhs, assumption.rhs})
    for (const Expr& symbol : side.free_symbols())
      KILN_CHECK(known.count(symbol.symbol_id()))
          << "trace assumption " << assumption.to_string() << " (" << assumption.reason << ") names "
          << symbol.to_string() << ", which is neither an input symbol nor an unresolved placeholder of the graph";
  KILN_CHECK(assumption.holds(known)) << "trace assumption " << assumption.to_string() << " (" << assumption.reason
                                      << ") does not hold at the hints";
  mutable_symbolic(g).trace_assumptions.push_back(std::move(assumption));
}

void mark_symbolic_int_arg(Graph& g, const SymbolicIntArg& arg) {
  KILN_CHECK(g.symbolic) << "mark input dims symbolic (or add placeholders) before int arguments";
  SymbolicSizes& s = mutable_symbolic(g);
  s.int_args.push_back(arg);
  try {
    verify_symbolic_sizes(g);
  } catch (const kiln::Error& e) {
    s.int_args.pop_back();
    KILN_CHECK(false) << "cannot mark that int argument symbolic: " << e.what();
  }
}

void add_size_argument(Graph& g, NodeIndex node, int32_t arg) {
  KILN_CHECK(node >= 0 && static_cast<size_t>(node) < g.nodes.size() && arg >= 0 &&
             static_cast<size_t>(arg) < g.nodes[node].args.size())
      << "size argument " << arg << " of node " << node << " does not exist";
  mutable_symbolic(g).size_args.push_back({node, arg});
}

void propagate_symbolic_sizes(Graph& g) {
  if (!g.symbolic) return;
  Propagation(g).run();
}

}  // namespace kiln::graph
