// Symbolic ints of a trace with dynamic dims (symbolic_ints.h).
#include "trace/symbolic_ints.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <tuple>

#include "common/error.h"
#include "common/log.h"
#include "compile/backends.h"
#include "graph/propagate_symbolic_sizes.h"
#include "graph/symbolic_sizes.h"
#include "trace/tracer.h"

namespace kiln::trace {

using graph::shape::Assumption;
using sym::Expr;

namespace {

thread_local SymbolicInts* g_active = nullptr;
thread_local int g_no_pin = 0;

PyObject* operator_fn(const char* name) {
  static PyObject* module = PyImport_ImportModule("operator");
  KILN_ASSERT(module) << "import operator";
  PyObject* f = PyObject_GetAttrString(module, name);
  KILN_ASSERT(f) << "operator." << name;
  Py_DECREF(f);  // (the module keeps it alive)
  return f;
}

enum class Op { kAdd, kSub, kMul, kFloorDiv, kMod, kLt, kLe, kGt, kGe, kEq, kNe, kOther };

Op op_of(PyObject* op) {
  static const std::vector<std::pair<PyObject*, Op>> table = {
      {operator_fn("add"), Op::kAdd},           {operator_fn("iadd"), Op::kAdd},
      {operator_fn("sub"), Op::kSub},           {operator_fn("isub"), Op::kSub},
      {operator_fn("mul"), Op::kMul},           {operator_fn("imul"), Op::kMul},
      {operator_fn("floordiv"), Op::kFloorDiv}, {operator_fn("ifloordiv"), Op::kFloorDiv},
      {operator_fn("mod"), Op::kMod},           {operator_fn("imod"), Op::kMod},
      {operator_fn("lt"), Op::kLt},             {operator_fn("le"), Op::kLe},
      {operator_fn("gt"), Op::kGt},             {operator_fn("ge"), Op::kGe},
      {operator_fn("eq"), Op::kEq},             {operator_fn("ne"), Op::kNe},
  };
  for (const auto& [f, o] : table)
    if (f == op) return o;
  return Op::kOther;
}

// A plain Python int (not a bool): its value.
bool plain_int(const VarPtr& v, int64_t* out) {
  if (!v->is(VarKind::kConst) || !PyLong_CheckExact(v->value)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v->value, &overflow);
  return overflow == 0 && !PyErr_Occurred();
}

// A kSymInt or a plain int as (hint, expression).
bool int_operand(const VarPtr& v, int64_t* hint, Expr* e) {
  if (v->is(VarKind::kSymInt)) {
    *hint = PyLong_AsLongLong(v->value);
    *e = v->sym;
    return true;
  }
  if (plain_int(v, hint)) {
    *e = Expr(*hint);
    return true;
  }
  return false;
}

std::string source_dim(const SourcePtr& s, int64_t dim) { return s->describe() + ".size(" + std::to_string(dim) + ")"; }

}  // namespace

SymbolicInts* active_symbolic_ints() { return g_active; }
SymbolicIntsScope::SymbolicIntsScope(SymbolicInts* s) : saved_(g_active) { g_active = s; }
SymbolicIntsScope::~SymbolicIntsScope() { g_active = saved_; }
NoPinScope::NoPinScope() { ++g_no_pin; }
NoPinScope::~NoPinScope() { --g_no_pin; }
bool pins_suppressed() { return g_no_pin > 0; }

bool DynamicPolicy::remember(const std::vector<SourcePtr>& sources, PyObject* inputs) {
  bool grew = false;
  for (size_t i = 0; i < sources.size() && (Py_ssize_t)i < PyList_GET_SIZE(inputs); ++i) {
    PyObject* shape = PyObject_GetAttrString(PyList_GET_ITEM(inputs, i), "shape");
    if (!shape) {
      PyErr_Clear();
      continue;
    }
    std::vector<int64_t> sizes;
    for (Py_ssize_t d = 0; d < PyTuple_Size(shape); ++d) sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d)));
    Py_DECREF(shape);
    const std::string path = sources[i]->describe();
    auto it = seen.find(path);
    if (it != seen.end() && it->second.size() == sizes.size())
      for (size_t d = 0; d < sizes.size(); ++d)
        if (it->second[d] != sizes[d]) grew = changed[path].insert((int64_t)d).second || grew;
    seen[path] = std::move(sizes);
  }
  return grew;
}

// ---- input symbols -------------------------------------------------------------------------------------------

std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> SymbolicInts::dynamic_dims(PyObject* real,
                                                                                       const SourcePtr& source) const {
  PyObject* shape = PyObject_GetAttrString(real, "shape");
  if (!shape) {
    PyErr_Clear();
    return {};
  }
  std::map<int64_t, std::pair<int64_t, int64_t>> ranges;
  std::vector<int64_t> sizes;
  for (Py_ssize_t i = 0; i < PyTuple_Size(shape); ++i) sizes.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
  Py_DECREF(shape);
  std::set<int64_t> dims;
  // Parameters, buffers and other tensors held by modules or globals are static unless marked (torch.compile's
  // default): only what the frame was called with varies, with its containers and its objects' attributes, as in
  // Dynamo. A transformers cache passed as an argument holds its keys in `cache.layers[i].keys`, whose length grows by
  // one per generated token (each length had compiled a graph until the recompile limit sent the rest to eager).
  bool reached_from_argument = true;
  for (const Source* s = source.get(); s; s = s->base().get()) {
    const SourceKind kind = s->kind();
    if (kind != SourceKind::kLocal && kind != SourceKind::kIndex && kind != SourceKind::kDictKey &&
        kind != SourceKind::kInstanceDict && kind != SourceKind::kAttr)
      reached_from_argument = false;
  }
  if (reached_from_argument && policy_.mode == compile::Dynamic::kDynamic)
    for (size_t d = 0; d < sizes.size(); ++d) dims.insert((int64_t)d);
  if (reached_from_argument && policy_.mode == compile::Dynamic::kAutomatic) {
    const std::string path = source->describe();
    auto it = policy_.changed.find(path);
    if (it != policy_.changed.end()) {
      dims.insert(it->second.begin(), it->second.end());
      if (!policy_.seen.count(path))  // changed, yet never seen here: the disk cache's profile
        for (int64_t d : it->second)
          KILN_LOG(dynamic) << "dim " << d << " of " << path << " is dynamic from the first call: its size changed in "
                            << "an earlier process (the disk cache's profile of " << policy_.profile_where << ")";
    }
    auto seen = policy_.seen.find(path);
    if (seen != policy_.seen.end() && seen->second.size() == sizes.size())
      for (size_t d = 0; d < sizes.size(); ++d)
        if (seen->second[d] != sizes[d]) {
          dims.insert((int64_t)d);
          KILN_LOG(dynamic) << "dim " << d << " of " << path << " is dynamic: it was " << seen->second[d]
                            << " and is now " << sizes[d];
        }
  }
  if (policy_.mode != compile::Dynamic::kStatic) {
    // kiln.mark_dynamic / mark_static (api.py stores them on the tensor).
    if (PyObject* marked = PyObject_GetAttrString(real, "_kiln_dynamic_dims")) {
      PyObject *key, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Check(marked) && PyDict_Next(marked, &pos, &key, &value)) {
        const int64_t d = PyLong_AsLongLong(key);
        dims.insert(d);
        auto bound = [&](Py_ssize_t i) -> int64_t {
          PyObject* b = PyTuple_Check(value) && PyTuple_GET_SIZE(value) == 2 ? PyTuple_GET_ITEM(value, i) : Py_None;
          return b == Py_None ? -1 : PyLong_AsLongLong(b);
        };
        ranges[d] = {bound(0), bound(1)};
      }
      Py_DECREF(marked);
    } else {
      PyErr_Clear();
    }
  }
  if (PyObject* fixed = PyObject_GetAttrString(real, "_kiln_static_dims")) {
    PyObject* it = PyObject_GetIter(fixed);
    while (PyObject* item = it ? PyIter_Next(it) : nullptr) {
      dims.erase(PyLong_AsLongLong(item));
      Py_DECREF(item);
    }
    Py_XDECREF(it);
    Py_DECREF(fixed);
  }
  PyErr_Clear();
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> out;
  for (int64_t d : dims) {
    if (d < 0 || d >= (int64_t)sizes.size()) continue;
    auto r = ranges.find(d);
    const std::pair<int64_t, int64_t> range = r == ranges.end() ? std::pair<int64_t, int64_t>{-1, -1} : r->second;
    // (A declared range is checked even where the size is 0 or 1 and stays specialised.)
    if (sizes[d] >= 2 || range.first >= 0 || range.second >= 0) out.push_back({d, range});
  }
  return out;
}

void SymbolicInts::add_input(PyObject* real, PyObject* fake, const SourcePtr& source, int input_index) {
  const auto dims = source ? dynamic_dims(real, source) : decltype(dynamic_dims(real, source)){};
  PyObject* shape = PyObject_GetAttrString(real, "shape");
  KILN_ASSERT(shape) << "an input tensor without a shape";
  std::vector<Expr> per_dim;
  InputDims in{input_index, source, {}, {}};
  for (Py_ssize_t d = 0; d < PyTuple_Size(shape); ++d) {
    const int64_t size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    auto marked = std::find_if(dims.begin(), dims.end(), [&](const auto& m) { return m.first == (int64_t)d; });
    if (marked != dims.end()) {
      const auto [lo, hi] = marked->second;
      if ((lo >= 0 && size < lo) || (hi >= 0 && size > hi) || size < 2) {
        if ((lo >= 0 && size < lo) || (hi >= 0 && size > hi))
          range_violation_ = source_dim(source, d) + " is " + std::to_string(size) + ", outside " + kDeclaredRange +
                             " for it: [" + (lo >= 0 ? std::to_string(lo) : "2") + ", " +
                             (hi >= 0 ? std::to_string(hi) : "inf") + "]";
        marked = dims.end();  // (sizes 0 and 1 stay specialised)
      }
    }
    if (marked == dims.end()) {
      per_dim.push_back(Expr(size));
      continue;
    }
    in.ranges.push_back(marked->second);
    Expr s = graph::input_size_symbol((int32_t)symbols_.size());
    // Duck sizing, as torch.compile's: dynamic dims of equal size at the trace are taken as one size (their equality
    // is guarded), so that `ids.shape[1]` and `mask.shape[1]` are the same expression and never ambiguous.
    Expr canonical = s;
    for (size_t k = 0; k < symbols_.size(); ++k)
      if (symbol_hints_[k] == size) {
        canonical = symbols_[k];
        assume(Assumption::Kind::kEq, s, canonical, "duck sizing: equal sizes at the first call are one size");
        break;
      }
    symbols_.push_back(s);
    symbol_hints_.push_back(size);
    in.dims.push_back(d);
    in.symbols.push_back(s);
    per_dim.push_back(canonical);
    KILN_LOG(dynamic) << s.to_string() << " = " << source_dim(source, d) << " (traced " << size << ")";
  }
  Py_DECREF(shape);
  input_fakes_[fake] = std::move(per_dim);
  if (!in.dims.empty()) inputs_.push_back(std::move(in));
}

// ---- sizes and arithmetic ------------------------------------------------------------------------------------

VarPtr SymbolicInts::make(int64_t hint, Expr e) {
  if (e.is_constant()) return make_const_steal(PyLong_FromLongLong(e.constant_value()));
  VarPtr v = make_const_steal(PyLong_FromLongLong(hint));
  v->kind = VarKind::kSymInt;
  v->sym = std::move(e);
  return v;
}

VarPtr SymbolicInts::size(PyObject* fake, int64_t value, int64_t dim, int64_t hint) {
  auto in = input_fakes_.find(fake);
  if (in != input_fakes_.end() && dim < (int64_t)in->second.size()) return make(hint, in->second[dim]);
  if (value < 0) return make_const_steal(PyLong_FromLongLong(hint));  // not a recorded value: a constant tensor
  auto [it, added] = placeholder_of_.try_emplace({value, dim});
  if (added) {
    it->second = graph::size_placeholder_symbol((int32_t)placeholders_.size());
    placeholders_.push_back({it->second, (graph::ValueId)value, (int32_t)dim, std::nullopt});
  }
  return make(hint, it->second);
}

VarPtr SymbolicInts::binary(PyObject* op, const VarPtr& a, const VarPtr& b) {
  int64_t x, y;
  Expr ex, ey;
  if (!int_operand(a, &x, &ex) || !int_operand(b, &y, &ey)) return nullptr;
  switch (op_of(op)) {
    case Op::kAdd: return make(x + y, ex + ey);
    case Op::kSub: return make(x - y, ex - ey);
    case Op::kMul: return make(x * y, ex * ey);
    case Op::kFloorDiv:
      if (y == 0) return nullptr;  // (Python raises ZeroDivisionError: the folding path does)
      return make(sym::int_floordiv(x, y), sym::floordiv(ex, ey));
    case Op::kMod:
      if (y == 0) return nullptr;
      return make(sym::int_mod(x, y), sym::mod(ex, ey));
    case Op::kLt:
    case Op::kGt:
    case Op::kLe:
    case Op::kGe: {
      const Op o = op_of(op);
      // As lhs < rhs or lhs <= rhs.
      const bool strict = o == Op::kLt || o == Op::kGt;
      const bool swap = o == Op::kGt || o == Op::kGe;
      const Expr& l = swap ? ey : ex;
      const Expr& r = swap ? ex : ey;
      const int64_t lv = swap ? y : x, rv = swap ? x : y;
      const bool holds = strict ? lv < rv : lv <= rv;
      // Not (l < r) is r <= l; not (l <= r) is r < l.
      if (holds)
        assume(strict ? Assumption::Kind::kLt : Assumption::Kind::kLe, l, r, "a comparison of sizes");
      else
        assume(strict ? Assumption::Kind::kLe : Assumption::Kind::kLt, r, l, "a comparison of sizes");
      return make_const(holds ? Py_True : Py_False);
    }
    case Op::kEq:
    case Op::kNe: {
      const bool equal = x == y;
      assume(equal ? Assumption::Kind::kEq : Assumption::Kind::kNe, ex, ey, "a comparison of sizes");
      return make_const((equal == (op_of(op) == Op::kEq)) ? Py_True : Py_False);
    }
    case Op::kOther: return nullptr;
  }
  return nullptr;
}

VarPtr SymbolicInts::negate(const VarPtr& a) {
  int64_t x;
  Expr e;
  if (!int_operand(a, &x, &e)) return nullptr;
  return make(-x, -e);
}

VarPtr SymbolicInts::min_max(bool is_max, const std::vector<VarPtr>& args) {
  if (args.size() < 2) return nullptr;
  std::vector<Expr> exprs;
  int64_t best = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    int64_t x;
    Expr e;
    if (!int_operand(args[i], &x, &e)) return nullptr;
    best = i == 0 ? x : is_max ? std::max(best, x) : std::min(best, x);
    exprs.push_back(e);
  }
  return make(best, is_max ? sym::max(exprs) : sym::min(exprs));
}

bool SymbolicInts::truthy(const VarPtr& v) {
  const int64_t x = PyLong_AsLongLong(v->value);
  assume(x != 0 ? Assumption::Kind::kNe : Assumption::Kind::kEq, v->sym, Expr(0), "the truth of a size");
  return x != 0;
}

VarPtr SymbolicInts::compare_tuples(PyObject* op, const VarPtr& a, const VarPtr& b) {
  if (op_of(op) != Op::kEq && op_of(op) != Op::kNe) return nullptr;
  const bool equal = op_of(op) == Op::kEq;
  auto ints = [](const VarPtr& t, std::vector<std::pair<int64_t, Expr>>& out) {
    if (!t->is(VarKind::kTuple)) return false;
    for (const VarPtr& item : t->items) {
      int64_t x;
      Expr e;
      if (!int_operand(item, &x, &e)) return false;
      out.emplace_back(x, e);
    }
    return true;
  };
  std::vector<std::pair<int64_t, Expr>> xs, ys;
  if (!ints(a, xs) || !ints(b, ys)) return nullptr;
  bool same = xs.size() == ys.size();
  if (same) {
    // Equal: every pair is relied on. Unequal: the first differing pair settles it.
    size_t first_difference = xs.size();
    for (size_t i = 0; i < xs.size() && first_difference == xs.size(); ++i)
      if (xs[i].first != ys[i].first) first_difference = i;
    if (first_difference == xs.size()) {
      for (size_t i = 0; i < xs.size(); ++i)
        assume(Assumption::Kind::kEq, xs[i].second, ys[i].second, "a comparison of shapes");
    } else {
      same = false;
      assume(Assumption::Kind::kNe, xs[first_difference].second, ys[first_difference].second,
             "a comparison of shapes");
    }
  }
  return make_const(same == equal ? Py_True : Py_False);
}

void SymbolicInts::assume(Assumption::Kind kind, const Expr& lhs, const Expr& rhs, std::string why) {
  Assumption a{kind, lhs, rhs, std::move(why)};
  if (lhs.is_constant() && rhs.is_constant()) return;  // settled at trace time whatever the sizes
  assumptions_.push_back(std::move(a));
}

void SymbolicInts::pin(const VarPtr& v, const std::string& why) {
  if (!v->is(VarKind::kSymInt)) return;
  const int64_t hint = PyLong_AsLongLong(v->value);
  KILN_LOG(dynamic) << v->sym.to_string() << " is specialised to " << hint << ": " << why;
  assume(Assumption::Kind::kEq, v->sym, Expr(hint), "specialised: " + why);
}

void SymbolicInts::note_call(int first_node, int end_node, std::vector<PassedInt> passed, std::string what,
                             bool returned_number) {
  // A call that answers with a Python number computed from the ints (not a tensor) pins them: the answer is a
  // trace-time constant.
  if (returned_number) {
    for (const PassedInt& p : passed)
      if (p.expr)
        assume(Assumption::Kind::kEq, *p.expr, Expr(p.value), "specialised: " + what + " returned a Python value computed from it");
    return;
  }
  if (end_node > first_node) {
    calls_.push_back({first_node, end_node, std::move(passed), std::move(what)});
    return;
  }
  // No op recorded: whatever the call made from the ints is baked into the graph (`torch.tensor(x.shape[0])`, a
  // constant tensor of the value), so they are pinned.
  for (const PassedInt& p : passed)
    if (p.expr)
      assume(Assumption::Kind::kEq, *p.expr, Expr(p.value),
             "specialised: " + what + " made a constant of it without recording an op");
}

void collect_passed_ints(const VarPtr& v, std::vector<PassedInt>& out) {
  if (v->is(VarKind::kSymInt)) {
    out.push_back({PyLong_AsLongLong(v->value), v->sym});
  } else if (v->is(VarKind::kConst) && PyLong_CheckExact(v->value)) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v->value, &overflow);
    if (!overflow) out.push_back({x, std::nullopt});
    PyErr_Clear();
  } else if (v->is(VarKind::kTuple) || v->is(VarKind::kList) || v->is(VarKind::kSlice) || v->is(VarKind::kDict)) {
    for (const VarPtr& item : v->items) collect_passed_ints(item, out);
  } else if (v->is(VarKind::kConst) && (PyTuple_CheckExact(v->value) || PyList_CheckExact(v->value))) {
    // A constant sequence (a list a comprehension over constants built, an index tuple `(..., slice(None, 4))`):
    // its ints, as literals.
    PyObject* items = PySequence_Fast(v->value, "a sequence");
    for (Py_ssize_t i = 0; items && i < PySequence_Fast_GET_SIZE(items); ++i)
      collect_passed_ints(make_const(PySequence_Fast_GET_ITEM(items, i)), out);
    Py_XDECREF(items);
    PyErr_Clear();
  } else if (v->is(VarKind::kConst) && PySlice_Check(v->value)) {
    auto* s = reinterpret_cast<PySliceObject*>(v->value);
    for (PyObject* bound : {s->start, s->stop, s->step}) collect_passed_ints(make_const(bound), out);
  }
}

// Each int handed to a call is found in the nodes the call recorded: a symbolic int becomes that argument's
// expression, a plain int a constant one (so that propagation never reads a literal as a size it happens to equal:
// graph/infer_recorded_sizes.h infers only the ints nobody passed, the ones ATen's composites computed).
// - An int list equal, element by element, to a run of the ints passed in argument order (`x.view(s, b * h, 64)`
//   recorded as view(x, [37, 64, 64])) is matched by position: no value is ambiguous there.
// - Otherwise by value. Two different expressions of one value (a length read from a sliced buffer and from the
//   input) are tied by a guarded equality, and either is then right. A value a plain int also has is ambiguous: its
//   symbolic ints are pinned rather than guessed. A plain int is read as a literal by value only where the call
//   recorded one node (`x.view(4, -1)`): a composite recorded whole (multi_head_attention_forward given
//   num_heads=8) computes sizes of its own that may equal it, and those are left to the inference.
// - A symbolic int no node holds was used some other way inside the call, and is pinned.
void SymbolicInts::match_call(graph::Graph& g, const Call& c) {
  const std::vector<PassedInt>& passed = c.passed;
  std::vector<bool> used(passed.size(), false), ambiguous(passed.size(), false);
  auto mark_arg = [&](graph::NodeIndex n, int32_t a, int32_t element, size_t k) {  // passed[k] stands there
    try {
      graph::mark_symbolic_int_arg(g, {n, a, element, passed[k].expr ? *passed[k].expr : Expr(passed[k].value)});
      return true;
    } catch (const Error&) {
      return false;  // (an argument that cannot stand for a size)
    }
  };
  auto by_value = [&](graph::NodeIndex n, int32_t a, int32_t element, int64_t value) {
    std::optional<size_t> symbolic, plain;
    for (size_t k = 0; k < passed.size(); ++k) {
      if (passed[k].value != value) continue;
      if (!passed[k].expr) {
        plain = plain ? plain : k;
      } else if (!symbolic) {
        symbolic = k;
      } else if (*passed[*symbolic].expr != *passed[k].expr) {
        assume(Assumption::Kind::kEq, *passed[k].expr, *passed[*symbolic].expr,
               "two sizes of equal value handed to " + c.what);
      }
    }
    if (symbolic && plain) {
      for (size_t k = 0; k < passed.size(); ++k) ambiguous[k] = ambiguous[k] || (passed[k].expr && passed[k].value == value);
      symbolic.reset();
    }
    if (symbolic) {
      const bool marked = mark_arg(n, a, element, *symbolic);
      for (size_t k = 0; k < passed.size(); ++k)  // (the others of this value are tied to it by the equality)
        if (passed[k].expr && passed[k].value == value) (marked ? used : ambiguous)[k] = true;
    } else if (plain && c.end_node - c.first_node == 1) {
      KILN_LOG(dynamic) << "node " << n << " (" << g.nodes[n].qualified_name() << ") argument " << a
                        << (element >= 0 ? "[" + std::to_string(element) + "]" : "") << " = " << value
                        << " is the constant " << c.what << " was passed";
      mark_arg(n, a, element, *plain);
    }
  };
  auto by_position = [&](graph::NodeIndex n, int32_t a, const std::vector<int64_t>& list) {
    if (list.size() < 2) return false;
    for (size_t start = 0; start + list.size() <= passed.size(); ++start) {
      bool equal = true;
      for (size_t e = 0; e < list.size() && equal; ++e) equal = passed[start + e].value == list[e];
      if (!equal) continue;
      for (size_t e = 0; e < list.size(); ++e) {
        const size_t k = start + e;
        const bool marked = mark_arg(n, a, (int32_t)e, k);
        if (passed[k].expr) (marked ? used : ambiguous)[k] = true;
      }
      return true;
    }
    return false;
  };
  // One node whose int arguments are the passed ints, in order (an op overload called with every argument, as
  // kiln's composite twins call them): each stands where it was passed, whatever values coincide.
  if (c.end_node - c.first_node == 1 && c.first_node < (int)g.nodes.size()) {
    std::vector<std::tuple<int32_t, int32_t, int64_t>> slots;  // (argument, element, value)
    const graph::Node& node = g.nodes[c.first_node];
    for (size_t a = 0; a < node.args.size(); ++a) {
      if (const auto* i = std::get_if<int64_t>(&node.args[a])) slots.emplace_back((int32_t)a, -1, *i);
      if (const auto* l = std::get_if<std::vector<int64_t>>(&node.args[a]))
        for (size_t e = 0; e < l->size(); ++e) slots.emplace_back((int32_t)a, (int32_t)e, (*l)[e]);
    }
    bool in_order = slots.size() == passed.size();
    for (size_t k = 0; k < slots.size() && in_order; ++k) in_order = std::get<2>(slots[k]) == passed[k].value;
    if (in_order) {
      for (size_t k = 0; k < passed.size(); ++k)  // (two expressions of one value are relied on to be equal, as below)
        for (size_t j = 0; j < k; ++j)
          if (passed[k].expr && passed[j].expr && passed[k].value == passed[j].value && *passed[k].expr != *passed[j].expr)
            assume(Assumption::Kind::kEq, *passed[k].expr, *passed[j].expr, "two sizes of equal value handed to " + c.what);
      for (size_t k = 0; k < slots.size(); ++k) {
        const bool marked = mark_arg(c.first_node, std::get<0>(slots[k]), std::get<1>(slots[k]), k);
        if (passed[k].expr && !marked)
          assume(Assumption::Kind::kEq, *passed[k].expr, Expr(passed[k].value),
                 "specialised: it cannot stand for a size in " + c.what);
      }
      return;
    }
  }
  for (int n = c.first_node; n < c.end_node && n < (int)g.nodes.size(); ++n) {
    const graph::Node& node = g.nodes[n];
    for (size_t a = 0; a < node.args.size(); ++a) {
      if (const auto* i = std::get_if<int64_t>(&node.args[a])) by_value(n, (int32_t)a, -1, *i);
      if (const auto* l = std::get_if<std::vector<int64_t>>(&node.args[a]))
        if (!by_position(n, (int32_t)a, *l))
          for (size_t e = 0; e < l->size(); ++e) by_value(n, (int32_t)a, (int32_t)e, (*l)[e]);
    }
  }
  for (size_t k = 0; k < passed.size(); ++k)
    if (passed[k].expr && (ambiguous[k] || !used[k]))
      assume(Assumption::Kind::kEq, *passed[k].expr, Expr(passed[k].value),
             std::string("specialised: ") + (ambiguous[k] ? "its value is ambiguous in " : "used inside ") + c.what);
}

// ---- the graph -----------------------------------------------------------------------------------------------

std::vector<std::pair<int32_t, int32_t>> recorded_size_arguments(PyObject* recorder) {
  PyObject* pairs = PyObject_CallMethod(recorder, "size_arguments", nullptr);
  if (!pairs) rethrow_python("recorder.size_arguments");
  std::vector<std::pair<int32_t, int32_t>> out;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); ++i) {
    PyObject* pair = PyList_GET_ITEM(pairs, i);
    out.emplace_back(PyLong_AsLong(PyTuple_GET_ITEM(pair, 0)), PyLong_AsLong(PyTuple_GET_ITEM(pair, 1)));
  }
  Py_DECREF(pairs);
  return out;
}

void SymbolicInts::finish(PyObject* graph_object, const std::vector<std::pair<int32_t, int32_t>>& size_arguments,
                          guards::GuardTree& guards, const std::vector<SourcePtr>& input_sources) {
  if (!active()) return;
  std::shared_ptr<graph::Graph> g = compile::graph_from_object(graph_object);
  for (const InputDims& in : inputs_) graph::mark_symbolic_dims(*g, in.input_index, in.dims, in.symbols);
  for (const graph::SizePlaceholder& p : placeholders_) graph::add_size_placeholder(*g, p);

  for (const Call& c : calls_) match_call(*g, c);
  for (const auto& [node, arg] : size_arguments) graph::add_size_argument(*g, node, arg);
  for (const Assumption& a : assumptions_) graph::add_trace_assumption(*g, a);
  graph::propagate_symbolic_sizes(*g);
  if (log::enabled(log::Category::dynamic)) KILN_LOG(dynamic) << "the graph over its size symbols:\n" << g->to_string();

  // The guards: each symbol the graph kept reads its input dim; the relations are the graph's assumptions and
  // specialisations (over input symbols only, now that placeholders are resolved).
  const graph::SymbolicSizes& s = *g->symbolic;
  guards::SizeGuard size_guard;
  std::map<int32_t, std::vector<int64_t>> dynamic_by_input;
  for (const graph::SymbolOrigin& o : s.symbols) {
    const SourcePtr& source = input_sources.at(o.input_index);
    size_guard.symbols.push_back({source, o.dim, o.symbol});
    dynamic_by_input[o.input_index].push_back(o.dim);
    summary_.push_back(o.symbol.to_string() + " = " + source_dim(source, o.dim));
  }
  for (const auto& [input, dims] : dynamic_by_input) guards.set_dynamic_dims(input_sources.at(input), dims);
  for (const InputDims& in : inputs_)
    for (size_t i = 0; i < in.dims.size(); ++i) {
      const auto [lo, hi] = in.ranges[i];
      const std::string range = std::string(kDeclaredRange) + " for " + source_dim(in.source, in.dims[i]);
      if (lo >= 0) size_guard.relations.push_back({Assumption::Kind::kLe, Expr(lo), in.symbols[i], range});
      if (hi >= 0) size_guard.relations.push_back({Assumption::Kind::kLe, in.symbols[i], Expr(hi), range});
    }
  for (const Assumption& a : s.assumptions) size_guard.relations.push_back(a);
  for (const graph::Specialisation& sp : s.specialisations)
    size_guard.relations.push_back({Assumption::Kind::kEq, sp.symbol, Expr(sp.value), "specialised: " + sp.reason});
  std::vector<Assumption> unique;
  for (Assumption& a : size_guard.relations)
    if (std::none_of(unique.begin(), unique.end(), [&](const Assumption& u) { return u.to_string() == a.to_string(); }))
      unique.push_back(std::move(a));
  size_guard.relations = std::move(unique);
  for (const Assumption& a : size_guard.relations) summary_.push_back(a.to_string() + " (" + a.reason + ")");
  guards.set_size_guard(std::move(size_guard));
  for (const std::string& line : summary_) KILN_LOG(dynamic) << line;
}

}  // namespace kiln::trace
