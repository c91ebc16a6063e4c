#include "guards/guard_tree.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <unordered_set>

#include "common/error.h"

namespace kiln::guards {

struct GuardTree::Node {
  SourcePtr source;
  std::vector<Check> checks;
  std::vector<Node*> children;  // owned by GuardTree::nodes_
};

namespace {
std::string repr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  if (!r) {
    PyErr_Clear();
    return "<unrepresentable>";
  }
  std::string s = PyUnicode_AsUTF8(r);
  Py_DECREF(r);
  return s;
}

// The object a weak check refers to (compared by address only, under the GIL), or nullptr once freed.
PyObject* weak_target(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  int alive = PyWeakref_GetRef(ref, &target);
  if (alive < 0) PyErr_Clear();
  if (alive <= 0) return nullptr;
  Py_DECREF(target);  // the referent is alive elsewhere, or the weak reference would be dead
  return target;
#else
  PyObject* target = PyWeakref_GET_OBJECT(ref);
  return target == Py_None ? nullptr : target;
#endif
}

// The object the check compares with, or nullptr when it was held weakly and has been freed.
PyObject* expected_object(const Check& c) { return c.weak ? weak_target(c.weak) : c.object; }

// Holds `object` for a check: weakly where its type allows, else by a strong reference.
void hold(Check& c, PyObject* object) {
  c.object = object;
  if (PyType_SUPPORTS_WEAKREFS(Py_TYPE(object))) {
    c.weak = PyWeakref_NewRef(object, nullptr);
    if (c.weak) return;
    PyErr_Clear();
  }
  Py_INCREF(object);
}

void release(Check& c) {
  if (c.weak) {
    Py_DECREF(c.weak);
  } else {
    Py_XDECREF(c.object);
  }
  c.weak = c.object = nullptr;
}

std::string describe_check(const std::string& path, const Check& c) {
  switch (c.kind) {
    case CheckKind::kType: return "type(" + path + ") is " + c.name + (expected_object(c) ? "" : " (a freed class)");
    case CheckKind::kId: return path + " is <" + c.name + " object>" + (expected_object(c) ? "" : " (freed)");
    case CheckKind::kConstant: return path + " == " + repr(c.object);
    case CheckKind::kTensor: return path + ": tensor " + describe_tensor_spec(c.tensor);
    case CheckKind::kLength: return "len(" + path + ") == " + std::to_string(c.length);
    case CheckKind::kDictKeys: return "list(" + path + ".keys()) == " + repr(c.object);
    case CheckKind::kHasNoAttr: return path + " has no attribute " + c.name;
    case CheckKind::kNoModuleHooks: return path + " has no forward, forward-pre or backward hooks";
    case CheckKind::kDictConstants: {
      std::string text;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c.object); ++i) {
        PyObject* pair = PyTuple_GET_ITEM(c.object, i);
        text += std::string(i ? ", " : "") + path + "." + PyUnicode_AsUTF8(PyTuple_GET_ITEM(pair, 0)) + " == " +
                repr(PyTuple_GET_ITEM(pair, 1));
      }
      return text;
    }
  }
  return path;
}

// The module __dict__ entries kNoModuleHooks reads.
const std::array<PyObject*, 3>& hook_dict_names() {
  static const std::array<PyObject*, 3> names = {PyUnicode_InternFromString("_forward_hooks"),
                                                 PyUnicode_InternFromString("_forward_pre_hooks"),
                                                 PyUnicode_InternFromString("_backward_hooks")};
  return names;
}

// The object's __dict__, or nullptr.
PyObject* instance_dict(PyObject* object) {
  PyObject** dictptr = _PyObject_GetDictPtr(object);
  return dictptr && *dictptr && PyDict_Check(*dictptr) ? *dictptr : nullptr;
}

// Reads a module's hook dicts (hook_dict_names) from its __dict__ into `hooks`; returns the index of the first one
// that is missing or not a dict, or -1.
int read_hook_dicts(PyObject* module, std::array<PyObject*, 3>& hooks) {
  PyObject* dict = instance_dict(module);
  for (size_t i = 0; i < hooks.size(); ++i) {
    hooks[i] = dict ? PyDict_GetItemWithError(dict, hook_dict_names()[i]) : nullptr;
    if (hooks[i] && PyDict_Check(hooks[i])) continue;
    if (PyErr_Occurred()) PyErr_Clear();
    return static_cast<int>(i);
  }
  return -1;
}

// kConstant's test: the same type and ==.
bool equal_constant(PyObject* value, PyObject* expected, std::string* why) {
  if (value == expected) return true;
  if (Py_TYPE(value) != Py_TYPE(expected)) {
    if (why) *why = std::string("expected ") + repr(expected) + ", got " + repr(value);
    return false;
  }
  int eq = PyObject_RichCompareBool(value, expected, Py_EQ);
  if (eq < 0) PyErr_Clear();
  if (eq == 1) return true;
  if (why) *why = "expected " + repr(expected) + ", got " + repr(value);
  return false;
}

bool same_check(const Check& a, const Check& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case CheckKind::kType:
    case CheckKind::kId: return a.object == b.object;
    case CheckKind::kLength: return a.length == b.length;
    case CheckKind::kHasNoAttr: return a.name == b.name;
    case CheckKind::kNoModuleHooks: return true;
    case CheckKind::kDictConstants: {  // a module called several times (one ReLU for three activations)
      const Py_ssize_t n = PyTuple_GET_SIZE(a.object);
      if (PyTuple_GET_SIZE(b.object) != n) return false;
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* x = PyTuple_GET_ITEM(a.object, i);
        PyObject* y = PyTuple_GET_ITEM(b.object, i);
        if (PyTuple_GET_ITEM(x, 0) != PyTuple_GET_ITEM(y, 0) ||
            !equal_constant(PyTuple_GET_ITEM(x, 1), PyTuple_GET_ITEM(y, 1), nullptr))
          return false;
      }
      return true;
    }
    default: return false;  // constants, tensors and keys on one path come once from the tracer
  }
}

// Returns true when `value` passes; writes the reason on failure when `why` is set.
bool run_check(const Check& c, PyObject* value, std::string* why) {
  switch (c.kind) {
    case CheckKind::kType: {
      PyObject* type = expected_object(c);
      if (type && (PyObject*)Py_TYPE(value) == type) return true;
      if (why) {
        *why = "expected type " + c.name + (type ? "" : " (freed since)") + ", got " + Py_TYPE(value)->tp_name;
        if (type && c.name == Py_TYPE(value)->tp_name) *why += " (another class of that name)";
      }
      return false;
    }
    case CheckKind::kId: {
      PyObject* object = expected_object(c);
      if (object && value == object) return true;
      if (why) *why = object ? "a different object than the one traced" : "the object traced has been freed";
      return false;
    }
    case CheckKind::kConstant: return equal_constant(value, c.object, why);
    case CheckKind::kTensor: return tensor_matches(value, c.tensor, why);
    case CheckKind::kLength: {
      Py_ssize_t n = PyObject_Length(value);
      if (n < 0) PyErr_Clear();
      if (n == c.length) return true;
      if (why) *why = "expected length " + std::to_string(c.length) + ", got " + std::to_string(n);
      return false;
    }
    case CheckKind::kDictKeys: {
      if (!PyDict_Check(value) || PyDict_GET_SIZE(value) != PyTuple_GET_SIZE(c.object)) {
        if (why) *why = "dict keys changed";
        return false;
      }
      Py_ssize_t pos = 0, i = 0;
      PyObject *k, *v;
      while (PyDict_Next(value, &pos, &k, &v)) {
        PyObject* expected = PyTuple_GET_ITEM(c.object, i++);
        if (k == expected) continue;
        int eq = PyObject_RichCompareBool(k, expected, Py_EQ);
        if (eq != 1) {
          if (eq < 0) PyErr_Clear();
          if (why) *why = "dict keys changed: expected " + repr(c.object);
          return false;
        }
      }
      return true;
    }
    case CheckKind::kHasNoAttr: {
      int has = PyObject_HasAttrString(value, c.name.c_str());
      if (!has) return true;
      if (why) *why = "attribute " + c.name + " appeared";
      return false;
    }
    case CheckKind::kNoModuleHooks: {
      std::array<PyObject*, 3> hooks;
      const int missing = read_hook_dicts(value, hooks);
      if (missing >= 0) {
        if (why) *why = std::string(PyUnicode_AsUTF8(hook_dict_names()[missing])) + " is missing";
        return false;
      }
      for (size_t i = 0; i < hooks.size(); ++i)
        if (PyDict_GET_SIZE(hooks[i]) != 0) {
          if (why) *why = std::string(PyUnicode_AsUTF8(hook_dict_names()[i])) + " is no longer empty";
          return false;
        }
      return true;
    }
    case CheckKind::kDictConstants: {
      PyObject* dict = instance_dict(value);
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c.object); ++i) {
        PyObject* pair = PyTuple_GET_ITEM(c.object, i);
        PyObject* name = PyTuple_GET_ITEM(pair, 0);
        PyObject* item = dict ? PyDict_GetItemWithError(dict, name) : nullptr;
        if (!item) {
          if (PyErr_Occurred()) PyErr_Clear();
          if (why) *why = std::string("attribute ") + PyUnicode_AsUTF8(name) + " is gone";
          return false;
        }
        if (!equal_constant(item, PyTuple_GET_ITEM(pair, 1), why)) {
          if (why) *why = std::string(PyUnicode_AsUTF8(name)) + ": " + *why;
          return false;
        }
      }
      return true;
    }
  }
  return false;
}
}  // namespace

GuardTree::GuardTree() = default;

GuardTree::~GuardTree() {
  for (auto& node : nodes_)
    for (Check& c : node->checks) release(c);
  Py_XDECREF(globals_);
}

bool GuardTree::expired() const {
  for (const auto& node : nodes_)
    for (const Check& c : node->checks)
      if (c.weak && !weak_target(c.weak)) return true;
  return false;
}

void GuardTree::set_instance(const SourcePtr& s, PyObject* module) {
  KILN_ASSERT(!s->base()) << "the instance guard must sit on a root source, got " << s->describe();
  add_id(s, module);
  Node* node = node_for(s);
  // Its identity check first, on the first root: instances of one module class differ there at once.
  for (size_t i = 0; i < node->checks.size(); ++i)
    if (node->checks[i].kind == CheckKind::kId && node->checks[i].object == module) {
      std::rotate(node->checks.begin(), node->checks.begin() + i, node->checks.begin() + i + 1);
      break;
    }
  auto at = std::find(roots_.begin(), roots_.end(), node);
  if (at != roots_.end()) std::rotate(roots_.begin(), at, at + 1);
  instance_ = module;
  instance_source_ = s;
}

namespace {
// The key of a source path: its description, made unique for paths from a fixed object (two closures' cells
// both read as `<cell __class__>` are different cells).
std::string path_key(const SourcePtr& s) {
  const Source* root = s.get();
  while (root->base()) root = root->base().get();
  std::string path = s->describe();
  if (root->kind() != SourceKind::kObject) return path;
  PyObject* object = root->resolve(SourceRoots{});
  if (!object) {
    PyErr_Clear();
    return path;
  }
  char address[32];
  std::snprintf(address, sizeof(address), "@%p:", (void*)object);
  Py_DECREF(object);
  return address + path;
}
}  // namespace

GuardTree::Node* GuardTree::node_for(const SourcePtr& s) {
  std::string path = path_key(s);
  auto it = by_path_.find(path);
  if (it != by_path_.end()) return it->second;
  Node* parent = s->base() ? node_for(s->base()) : nullptr;
  nodes_.push_back(std::make_unique<Node>());
  Node* node = nodes_.back().get();
  (parent ? parent->children : roots_).push_back(node);
  node->source = s;
  by_path_[path] = node;
  return node;
}

namespace {
void add(GuardTree::Node* n, Check c) {
  for (const Check& existing : n->checks)
    if (same_check(existing, c)) {
      release(c);
      return;
    }
  n->checks.push_back(std::move(c));
}
}  // namespace

void GuardTree::add_type(const SourcePtr& s, PyTypeObject* type) {
  Check c{CheckKind::kType};
  c.name = type->tp_name;
  // Held weakly: a class that dies (one defined inside a function, per call) can have its address taken by
  // a new class, which a bare pointer would let pass; a freed class fails the check instead.
  hold(c, (PyObject*)type);
  add(node_for(s), std::move(c));
}

void GuardTree::add_id(const SourcePtr& s, PyObject* object) {
  Check c{CheckKind::kId};
  c.name = Py_TYPE(object)->tp_name;
  hold(c, object);
  add(node_for(s), std::move(c));
}

void GuardTree::add_constant(const SourcePtr& s, PyObject* value) {
  Node* n = node_for(s);
  for (const Check& existing : n->checks)
    if (existing.kind == CheckKind::kConstant) return;
  Check c{CheckKind::kConstant};
  Py_INCREF(value);
  c.object = value;
  add(n, std::move(c));
}

void GuardTree::add_tensor(const SourcePtr& s, PyObject* tensor) {
  Node* n = node_for(s);
  for (const Check& existing : n->checks)
    if (existing.kind == CheckKind::kTensor) return;
  Check c{CheckKind::kTensor};
  c.tensor = tensor_spec_of(tensor);
  add(n, std::move(c));
}

void GuardTree::set_dynamic_dims(const SourcePtr& s, const std::vector<int64_t>& dims) {
  Node* n = node_for(s);
  for (Check& c : n->checks) {
    if (c.kind != CheckKind::kTensor) continue;
    TensorSpec& spec = c.tensor;
    const size_t rank = spec.sizes.size();
    if (spec.dynamic.empty()) spec.dynamic.assign(rank, false);
    for (int64_t d : dims) spec.dynamic.at(d < 0 ? d + (int64_t)rank : d) = true;
    // The dense order the symbolic strides assume (graph/propagate_symbolic_sizes.cpp: input_strides): innermost
    // first, equal strides in row-major order; none when the traced strides are not dense.
    std::vector<int> order(rank);
    for (size_t d = 0; d < rank; ++d) order[d] = (int)d;
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return spec.strides[a] != spec.strides[b] ? spec.strides[a] < spec.strides[b] : a > b;
    });
    long long running = 1;
    spec.dense_order = order;
    for (int d : order) {
      if (spec.strides[d] != running) {
        spec.dense_order.clear();
        break;
      }
      running *= std::max<long long>(spec.sizes[d], 1);
    }
    return;
  }
  KILN_ASSERT(false) << "set_dynamic_dims: " << s->describe() << " has no tensor check";
}

bool GuardTree::check_size_relations(const SourceRoots& roots, std::string* why) const {
  if (size_guard_.relations.empty()) return true;
  graph::sym::Bindings values;
  for (const SizeGuard::Symbol& sym : size_guard_.symbols) {
    PyObject* v = sym.source->resolve(roots);
    if (!v) {
      PyErr_Clear();
      if (why) *why = sym.source->describe() + " is unbound";
      return false;
    }
    values[sym.symbol.symbol_id()] = tensor_size(v, sym.dim);  // (its tensor check passed: the dim exists)
    Py_DECREF(v);
  }
  for (const graph::shape::Assumption& a : size_guard_.relations) {
    bool holds = false;
    try {
      holds = a.holds(values);
    } catch (const std::exception&) {
      holds = false;  // (a division by zero or an overflow at these sizes: not the sizes the graph was made for)
    }
    if (!holds) {
      if (why) {
        std::string at;
        for (const SizeGuard::Symbol& sym : size_guard_.symbols)
          at += (at.empty() ? "" : ", ") + sym.symbol.to_string() + " = " + sym.source->describe() + ".size(" +
                std::to_string(sym.dim) + ") = " + std::to_string(values[sym.symbol.symbol_id()]);
        *why = "size relation " + a.to_string() + " (" + a.reason + ") fails at " + at;
      }
      return false;
    }
  }
  return true;
}

void GuardTree::add_length(const SourcePtr& s, long long length) {
  Check c{CheckKind::kLength};
  c.length = length;
  add(node_for(s), std::move(c));
}

void GuardTree::add_has_no_attr(const SourcePtr& s, const std::string& name) {
  Check c{CheckKind::kHasNoAttr};
  c.name = name;
  add(node_for(s), std::move(c));
}

void GuardTree::add_no_module_hooks(const SourcePtr& s) { add(node_for(s), Check{CheckKind::kNoModuleHooks}); }

void GuardTree::add_dict_constants(const SourcePtr& s, PyObject* pairs) {
  Check c{CheckKind::kDictConstants};
  c.object = pairs;
  add(node_for(s), std::move(c));
}

void GuardTree::add_dict_keys(const SourcePtr& s, PyObject* keys_tuple) {
  Check c{CheckKind::kDictKeys};
  Py_INCREF(keys_tuple);
  c.object = keys_tuple;
  add(node_for(s), std::move(c));
}

void GuardTree::add_globals_identity(PyObject* globals) {
  Py_XINCREF(globals);
  Py_XSETREF(globals_, globals);
}

void GuardTree::add_same_object(const SourcePtr& a, const SourcePtr& b) {
  if (a->describe() != b->describe()) same_objects_.emplace_back(a, b);
}

bool GuardTree::check_same_objects(const SourceRoots& roots, std::string* why) const {
  for (const auto& [a, b] : same_objects_) {
    PyObject* x = a->resolve(roots);
    PyObject* y = x ? b->resolve(roots) : nullptr;
    if (!y) PyErr_Clear();
    bool same = x && y && x == y;
    Py_XDECREF(x);
    Py_XDECREF(y);
    if (!same) {
      if (why) *why = a->describe() + " and " + b->describe() + " are no longer the same object";
      return false;
    }
  }
  return true;
}

bool GuardTree::check_node(const Node& n, PyObject* value, const SourceRoots& roots, std::string* why) const {
  for (const Check& c : n.checks) {
    if (!run_check(c, value, why)) {
      if (why) *why = n.source->describe() + ": " + *why;
      return false;
    }
  }
  for (const Node* child : n.children) {
    PyObject* v = child->source->resolve_from(value, roots);
    if (!v) {
      PyErr_Clear();
      if (why) *why = child->source->describe() + " no longer exists";
      return false;
    }
    bool ok = check_node(*child, v, roots, why);
    Py_DECREF(v);
    if (!ok) return false;
  }
  return true;
}

// One walk for both uses: `why` is null on the hot path (check) and filled for recompile logs.
bool GuardTree::evaluate(const SourceRoots& roots, std::string* why) const {
  if (globals_ && roots.globals != globals_) {
    if (why) *why = "the function's globals are a different dict";
    return false;
  }
  GlobalState now = GlobalState::current();
  if (!any_global_state_ && !(now == state_)) {
    if (why) *why = "global state changed: expected " + state_.describe() + ", got " + now.describe();
    return false;
  }
  for (const Node* n : roots_) {
    PyObject* v = n->source->resolve(roots);
    if (!v) {
      PyErr_Clear();
      if (why) *why = n->source->describe() + " is unbound";
      return false;
    }
    bool ok = check_node(*n, v, roots, why);
    Py_DECREF(v);
    if (!ok) return false;
  }
  return check_same_objects(roots, why) && check_size_relations(roots, why);
}

// ---- snapshots (guard_tree.h, GuardTree::Snapshot) ----------------------------------------------------------
namespace {

// Dict version tags exist up to CPython 3.13 (deprecated since 3.12, without a replacement that a reader can
// poll); newer versions walk the whole tree every call.
#if PY_VERSION_HEX < 0x030E0000
constexpr bool kSnapshots = true;
unsigned long long dict_version(PyObject* dict) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag;
#pragma GCC diagnostic pop
}
#else
constexpr bool kSnapshots = false;
unsigned long long dict_version(PyObject*) { return 0; }
#endif

// Snapshots in a row dropped by the call after them before a tree stops taking any (a model that sets an
// attribute of one of its modules in every call); a snapshot that passes resets the count.
constexpr int kMaxStaleSnapshots = 8;

class SnapshotBuilder {
 public:
  explicit SnapshotBuilder(GuardTree::Snapshot& s) : s_(s) {}

  // Records `dict`, reached by a lookup in a dict recorded before, with its version tag.
  void add_dict(PyObject* dict) {
    if (seen_.insert(dict).second) s_.steps.push_back({nullptr, dict, dict_version(dict)});
  }
  // Records that `object`'s entries are read from its current __dict__; false when it has none.
  bool add_owner(PyObject* object) {
    PyObject* dict = instance_dict(object);
    if (!dict) return false;
    if (seen_.insert(object).second) {
      seen_.insert(dict);
      s_.steps.push_back({object, dict, dict_version(dict)});
    }
    return true;
  }
  // The value `child` reaches from `base` when that step reads dicts only (recorded), else nullptr.
  PyObject* dict_step(const Source& child, PyObject* base) {
    switch (child.kind()) {
      case SourceKind::kModuleSlot: {
        PyObject* dict = instance_dict(base);
        PyObject* slot = dict ? PyDict_GetItemWithError(dict, child.py_slot()) : nullptr;
        PyObject* item = slot && PyDict_Check(slot) ? PyDict_GetItemWithError(slot, child.py_name()) : nullptr;
        if (!item) break;
        add_owner(base);
        add_dict(slot);
        return item;
      }
      case SourceKind::kInstanceDict: {
        PyObject* dict = instance_dict(base);
        PyObject* item = dict ? PyDict_GetItemWithError(dict, child.py_name()) : nullptr;
        if (!item) break;
        add_owner(base);
        return item;
      }
      case SourceKind::kDictKey: {
        PyObject* item = PyDict_Check(base) ? PyDict_GetItemWithError(base, child.py_name()) : nullptr;
        if (!item) break;
        add_dict(base);
        return item;
      }
      case SourceKind::kIndex:  // a tuple never changes
        if (PyTuple_CheckExact(base) && child.index() >= 0 && child.index() < PyTuple_GET_SIZE(base))
          return PyTuple_GET_ITEM(base, child.index());
        break;
      default: break;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return nullptr;
  }
  // True when the unchanged dicts recorded for `value` make `c` pass again; records what that needs.
  bool covers(const Check& c, PyObject* value) {
    switch (c.kind) {
      case CheckKind::kId:  // the value is the object its dicts (or the root's identity) pin
        return true;
      case CheckKind::kConstant:  // ... and constants are immutable, except a set read as one (trace/sets.cpp)
        return !PyAnySet_CheckExact(c.object) || PyFrozenSet_CheckExact(c.object);
      case CheckKind::kDictConstants: return add_owner(value);
      case CheckKind::kNoModuleHooks: {
        std::array<PyObject*, 3> hooks;
        if (read_hook_dicts(value, hooks) >= 0) return false;
        add_owner(value);  // before the hook dicts: they are reached through it
        for (PyObject* h : hooks) add_dict(h);
        return true;
      }
      case CheckKind::kDictKeys:
        if (!PyDict_Check(value)) return false;
        add_dict(value);
        return true;
      default: return false;  // tensors, types, lengths of lists, absent attributes: checked each call
    }
  }

 private:
  GuardTree::Snapshot& s_;
  std::unordered_set<PyObject*> seen_;
};

// A check that cannot run Python code on `value` (no __eq__, __len__ or __getattr__ of a user class).
bool runs_no_python(const Check& c, PyObject* value) {
  switch (c.kind) {
    case CheckKind::kType:
    case CheckKind::kTensor:
    case CheckKind::kNoModuleHooks: return true;
    case CheckKind::kLength: return PyList_CheckExact(value) || PyTuple_CheckExact(value) || PyDict_CheckExact(value);
    default: return false;
  }
}

// Records node `n`, whose value `value` is pinned, and below it.
void snapshot_node(SnapshotBuilder& b, GuardTree::Snapshot& s, const GuardTree::Node& n, PyObject* value) {
  for (const Check& c : n.checks) {
    if (b.covers(c, value)) continue;
    (runs_no_python(c, value) ? s.rechecks : s.python_rechecks).push_back({&c, value});
  }
  for (const GuardTree::Node* child : n.children) {
    if (PyObject* v = b.dict_step(*child->source, value)) {
      snapshot_node(b, s, *child, v);
    } else {
      s.subtrees.push_back({child, value});
    }
  }
}

// Strong references for the part of a snapshot check that may run Python code (which could drop the last other
// reference to an object the snapshot reads).
class Held {
 public:
  void add(PyObject* o) {
    Py_INCREF(o);
    objects_.push_back(o);
  }
  ~Held() {
    for (PyObject* o : objects_) Py_DECREF(o);
  }

 private:
  std::vector<PyObject*> objects_;
};

}  // namespace

void GuardTree::build_snapshot(const SourceRoots& roots) const {
  if (!kSnapshots || stale_snapshots_ >= kMaxStaleSnapshots) return;
  auto s = std::make_shared<Snapshot>();
  SnapshotBuilder builder(*s);
  for (const Node* n : roots_) {
    const Check* identity = nullptr;
    for (const Check& c : n->checks)
      if (c.kind == CheckKind::kId && !identity) identity = &c;
    if (!identity) {
      s->other_roots.push_back(n);
      continue;
    }
    PyObject* v = n->source->resolve(roots);
    if (!v) {
      PyErr_Clear();
      return;
    }
    s->pinned_roots.emplace_back(n, identity);
    snapshot_node(builder, *s, *n, v);
    Py_DECREF(v);  // the frame holds it; each call compares the root with its identity check first
  }
  snapshot_ = std::move(s);
}

int GuardTree::check_snapshot(const SourceRoots& roots) const {
  const std::shared_ptr<const Snapshot> keep = snapshot_;
  const Snapshot& s = *keep;
  for (const auto& [n, identity] : s.pinned_roots) {
    PyObject* v = n->source->resolve(roots);  // a root's lookup runs no Python code
    if (!v) {
      PyErr_Clear();
      return 0;
    }
    const bool same = run_check(*identity, v, nullptr);
    Py_DECREF(v);
    if (!same) return 0;
  }
  for (const Snapshot::Step& step : s.steps)
    if ((step.object && instance_dict(step.object) != step.dict) || dict_version(step.dict) != step.version) {
      snapshot_.reset();
      ++stale_snapshots_;
      return -1;
    }
  for (const Snapshot::Recheck& r : s.rechecks)
    if (!run_check(*r.check, r.value, nullptr)) return 0;
  Held held;
  for (const Snapshot::Recheck& r : s.python_rechecks) held.add(r.value);
  for (const Snapshot::Subtree& t : s.subtrees) held.add(t.parent);
  for (const Snapshot::Recheck& r : s.python_rechecks)
    if (!run_check(*r.check, r.value, nullptr)) return 0;
  for (const Snapshot::Subtree& t : s.subtrees) {
    PyObject* v = t.node->source->resolve_from(t.parent, roots);
    if (!v) {
      PyErr_Clear();
      return 0;
    }
    const bool ok = check_node(*t.node, v, roots, nullptr);
    Py_DECREF(v);
    if (!ok) return 0;
  }
  for (const Node* n : s.other_roots) {
    PyObject* v = n->source->resolve(roots);
    if (!v) {
      PyErr_Clear();
      return 0;
    }
    const bool ok = check_node(*n, v, roots, nullptr);
    Py_DECREF(v);
    if (!ok) return 0;
  }
  if (!check_same_objects(roots, nullptr) || !check_size_relations(roots, nullptr)) return 0;
  stale_snapshots_ = 0;
  return 1;
}

SnapshotStats& snapshot_stats() {
  static SnapshotStats stats;
  return stats;
}

bool GuardTree::check(const SourceRoots& roots) const {
  if (snapshot_) {
    if (globals_ && roots.globals != globals_) return false;
    if (!any_global_state_ && !(GlobalState::current() == state_)) return false;
    const int verdict = check_snapshot(roots);
    ++(verdict >= 0 ? snapshot_stats().hits : snapshot_stats().stale);
    if (verdict >= 0) return verdict == 1;
  }
  if (!evaluate(roots, nullptr)) return false;
  build_snapshot(roots);
  return true;
}

std::string GuardTree::explain_failure(const SourceRoots& roots) const {
  std::string why;
  return evaluate(roots, &why) ? "all guards pass" : why;
}

std::vector<std::string> GuardTree::describe() const {
  std::vector<std::string> lines;
  lines.push_back(any_global_state_ ? "any global state" : state_.describe());
  for (const auto& entry : by_path_)
    for (const Check& c : entry.second->checks) lines.push_back(describe_check(entry.second->source->describe(), c));
  for (const SizeGuard::Symbol& sym : size_guard_.symbols)
    lines.push_back("size symbol " + sym.symbol.to_string() + " = " + sym.source->describe() + ".size(" +
                    std::to_string(sym.dim) + ")");
  for (const graph::shape::Assumption& a : size_guard_.relations)
    lines.push_back("size relation " + a.to_string() + " (" + a.reason + ")");
  return lines;
}

size_t GuardTree::num_checks() const {
  size_t n = size_guard_.relations.size();
  for (const auto& entry : by_path_) n += entry.second->checks.size();
  return n;
}

}  // namespace kiln::guards
