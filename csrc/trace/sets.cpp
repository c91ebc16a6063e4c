// Sets in traced code: `memo = set()` in nn.Module.named_modules, `{*a, *b}`, `seen.add(m)`, `name in SKIP`.
//
// A kSet keeps the real set eager would have: its value is a Python set (or frozenset) of the elements' trace-time
// objects (constants as they are, a module itself, a tensor's fake), built and changed by the very calls eager makes
// (set(x), add, |=, ...). Membership, deduplication and iteration order are then CPython's own, the order included,
// which depends on the set's history (a set that lost elements keeps its larger table). keys[i] is the object
// standing for items[i], and items follow the real set's iteration order after every change.
//
// Elements: constants, modules (hashed by identity, pinned by their guards) and tensors (hashed by identity: eager's
// order among tensors depends on their addresses, kiln's on the fakes', as any order between them would). A value
// pinned only by its type (another instance on the next call) or held only in the trace is refused: its hash is its
// identity, which the trace cannot know.
#include <unordered_map>

#include "common/error.h"
#include "trace/call_helpers.h"
#include "trace/traced_raise.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

// The trace-time objects of Vars, and the Var behind each object (the first one seen: equal constants are one).
class SetKeys {
 public:
  ~SetKeys() {
    for (PyObject* k : held_) Py_DECREF(k);
  }
  // The object standing for `v` in a real set (borrowed; held here). A TypeError for an unhashable value, as eager.
  PyObject* key(const VarPtr& v) {
    PyObject* k = nullptr;
    switch (v->kind) {
      case VarKind::kConst:
        if (v->by_type) KILN_UNSUPPORTED() << "a " << v->describe() << " (pinned by its type only) as a set element";
        k = Py_NewRef(v->value);
        break;
      case VarKind::kModule:
      case VarKind::kTensor: k = Py_NewRef(v->value); break;
      case VarKind::kSymInt:
      case VarKind::kTuple:
        if (is_constant(v)) k = to_python(v);
        if (!k && PyErr_Occurred()) rethrow_python("a set element");
        break;
      case VarKind::kSet:  // a frozenset inside a set; a set raises TypeError below
        k = Py_NewRef(v->value);
        break;
      case VarKind::kList:
      case VarKind::kDict:
        PyErr_Format(PyExc_TypeError, "unhashable type: '%s'", v->is(VarKind::kList) ? "list" : "dict");
        raise_pending("a set element");
      default: break;
    }
    if (!k) KILN_UNSUPPORTED() << "a " << v->describe() << " as a set element";
    held_.push_back(k);
    if (PyObject_Hash(k) == -1) raise_pending("hashing a set element");
    vars_.emplace(k, v);
    return k;
  }
  // Registers the elements of the kSet `s` (their objects are its keys).
  void add_set(const VarPtr& s) {
    for (size_t i = 0; i < s->items.size(); ++i) vars_.emplace(s->keys[i], s->items[i]);
  }
  // The Python value eager would pass for `v` as a set method's argument or an operand: a set's own real set, a
  // constant itself, or a list of the keys of any other iterable's items.
  PyObject* operand(Tracer& tracer, const VarPtr& v) {
    if (v->is(VarKind::kSet)) {
      add_set(v);
      return Py_NewRef(v->value);
    }
    if (v->is(VarKind::kConst) && !v->by_type) return Py_NewRef(v->value);
    PyObject* list = PyList_New(0);
    for (const VarPtr& item : tracer.iterate(v)) {
      PyObject* k = key(item);
      if (PyList_Append(list, k) < 0) {
        Py_DECREF(list);
        rethrow_python("a set operand");
      }
    }
    return list;
  }
  VarPtr var_of(PyObject* object) {
    auto it = vars_.find(object);
    if (it != vars_.end()) return it->second;
    // An element of a constant operand (a frozenset constant, a tuple of strings): a constant itself.
    return make_const(object);
  }
  // Sets `s`'s items and keys from its real set, in its iteration order.
  void refresh(const VarPtr& s) {
    std::vector<VarPtr> items;
    std::vector<PyObject*> keys;
    PyObject* it = PyObject_GetIter(s->value);
    if (!it) rethrow_python("iterating a set");
    while (PyObject* e = PyIter_Next(it)) {
      items.push_back(var_of(e));
      keys.push_back(e);  // the reference PyIter_Next gave
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) rethrow_python("iterating a set");
    for (PyObject* k : s->keys) Py_DECREF(k);
    s->keys = std::move(keys);
    s->items = std::move(items);
  }
  // A new kSet Var over the real set `real` (a new reference, stolen).
  VarPtr make(PyObject* real) {
    VarPtr s = make_set_var(Py_TYPE(real), {});
    s->value = real;
    refresh(s);
    return s;
  }

 private:
  std::vector<PyObject*> held_;
  std::unordered_map<PyObject*, VarPtr> vars_;
};

bool is_set_type(PyObject* t) { return t == (PyObject*)&PySet_Type || t == (PyObject*)&PyFrozenSet_Type; }

// Refuses changing a set the trace does not own: one read from the frame is re-read from there, unchanged.
void claim(const VarPtr& s, const std::string& what) {
  if (s->source) KILN_UNSUPPORTED() << what << " of a set from outside the traced code";
  if (s->real_type != &PySet_Type) KILN_UNSUPPORTED() << what << " of a " << s->real_type->tp_name;
}

}  // namespace

VarPtr Tracer::frame_set(PyObject* value, const SourcePtr& source) {
  std::vector<VarPtr> items;
  std::vector<PyObject*> keys;
  PyObject* it = PyObject_GetIter(value);
  if (!it) rethrow_python("iterating a set");
  while (PyObject* e = PyIter_Next(it)) {
    if (e != Py_None && !PyBool_Check(e) && !PyLong_CheckExact(e) && !PyFloat_CheckExact(e) && !PyUnicode_CheckExact(e) &&
        !PyBytes_CheckExact(e)) {
      Py_DECREF(e);
      Py_DECREF(it);
      for (PyObject* k : keys) Py_DECREF(k);
      return nullptr;
    }
    items.push_back(make_const(e));
    keys.push_back(e);
  }
  Py_DECREF(it);
  // Guarded against a copy: the set itself may change after this call (the guard tree rechecks a mutable constant
  // even where the dicts that lead to it are unchanged).
  PyObject* snapshot = PySet_CheckExact(value) ? PySet_New(value) : Py_NewRef(value);
  if (!snapshot) rethrow_python("copying a set");
  guards_->add_constant(source, snapshot);
  Py_DECREF(snapshot);
  VarPtr s = make_set_var(Py_TYPE(value), std::move(items), source);
  s->value = Py_NewRef(value);  // never changed by the trace (claim refuses): iterated in the order eager sees
  s->keys = std::move(keys);
  return s;
}

VarPtr Tracer::make_set(PyTypeObject* type, const std::vector<VarPtr>& items) {
  SetKeys keys;
  PyObject* real = PySet_New(nullptr);
  if (!real) rethrow_python("set()");
  for (const VarPtr& item : items) {
    PyObject* k = nullptr;
    try {
      k = keys.key(item);
    } catch (...) {
      Py_DECREF(real);
      throw;
    }
    if (PySet_Add(real, k) < 0) {
      Py_DECREF(real);
      raise_pending("building a set");
    }
  }
  if (type == &PyFrozenSet_Type) Py_SETREF(real, PyFrozenSet_New(real));
  return keys.make(real);
}

void Tracer::set_add(const VarPtr& s, const std::vector<VarPtr>& items) {
  claim(s, "adding to");
  SetKeys keys;
  keys.add_set(s);
  for (const VarPtr& item : items)
    if (PySet_Add(s->value, keys.key(item)) < 0) raise_pending("set.add");
  keys.refresh(s);
}

VarPtr Tracer::set_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  if (!is_set_type(f) || !kwargs.empty() || args.size() > 1) return nullptr;
  SetKeys keys;
  PyObject* real = args.empty() ? PyObject_CallNoArgs(f) : nullptr;
  if (!args.empty()) {
    PyObject* operand = keys.operand(*this, args[0]);
    real = PyObject_CallOneArg(f, operand);
    Py_DECREF(operand);
  }
  if (!real) raise_pending(std::string(((PyTypeObject*)f)->tp_name) + "()");
  // frozenset(fs) is fs itself in eager: the same Var.
  if (!args.empty() && args[0]->is(VarKind::kSet) && real == args[0]->value) {
    Py_DECREF(real);
    return args[0];
  }
  return keys.make(real);
}

bool Tracer::set_contains(const VarPtr& s, const VarPtr& item) {
  SetKeys keys;
  int r = PySet_Contains(s->value, keys.key(item));
  if (r < 0) raise_pending("'in' on a set");
  return r == 1;
}

VarPtr Tracer::set_method(const VarPtr& self, const std::string& name, const std::vector<VarPtr>& args) {
  static const char* const kChanging[] = {"add", "discard", "remove", "pop", "clear", "update", "intersection_update",
                                          "difference_update", "symmetric_difference_update"};
  static const char* const kReading[] = {"union", "intersection", "difference", "symmetric_difference", "copy",
                                         "issubset", "issuperset", "isdisjoint", "__contains__", "__len__"};
  bool changing = false, known = false;
  for (const char* m : kChanging) changing = changing || name == m;
  for (const char* m : kReading) known = known || name == m;
  if (!changing && !known) KILN_UNSUPPORTED() << "method " << name << " of a " << self->describe();
  if (changing) claim(self, "set." + name);
  SetKeys keys;
  keys.add_set(self);
  PyObject* real_args = PyTuple_New(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    // add/discard/remove/__contains__ take one element; the others take iterables.
    const bool element = name == "add" || name == "discard" || name == "remove" || name == "__contains__";
    PyObject* a = nullptr;
    try {
      a = element ? Py_NewRef(keys.key(args[i])) : keys.operand(*this, args[i]);
    } catch (...) {
      Py_DECREF(real_args);
      throw;
    }
    PyTuple_SET_ITEM(real_args, i, a);
  }
  PyObject* method = PyObject_GetAttrString(self->value, name.c_str());
  PyObject* r = method ? PyObject_Call(method, real_args, nullptr) : nullptr;
  Py_XDECREF(method);
  Py_DECREF(real_args);
  if (!r) raise_pending("set." + name);  // remove/pop of what is not there: KeyError, as in eager
  VarPtr out;
  if (name == "pop") {
    out = keys.var_of(r);
    Py_DECREF(r);
  } else if (PyAnySet_CheckExact(r) && r != self->value) {
    out = keys.make(r);
  } else {
    out = r == self->value ? self : make_const(r);
    Py_DECREF(r);
  }
  if (changing) keys.refresh(self);
  return out;
}

VarPtr Tracer::set_binary(PyObject* op, const VarPtr& a, const VarPtr& b) {
  if (!a->is(VarKind::kSet) && !b->is(VarKind::kSet) && !is_dict_view(a) && !is_dict_view(b)) return nullptr;
  auto real = [&](SetKeys& keys, const VarPtr& v) -> PyObject* {
    if (v->is(VarKind::kSet)) {
      keys.add_set(v);
      return Py_NewRef(v->value);
    }
    if (is_dict_view(v)) {  // set-like: its operators and comparisons are a set's of its elements
      PyObject* elements = keys.operand(*this, v);
      PyObject* set = PySet_New(elements);
      Py_DECREF(elements);
      if (!set) rethrow_python("a dict view as a set");
      return set;
    }
    if (is_constant(v) && !v->by_type) return to_python(v);
    KILN_UNSUPPORTED() << "operator on a set and a " << v->describe();
  };
  SetKeys keys;
  PyObject* x = real(keys, a);
  PyObject* y = nullptr;
  try {
    y = real(keys, b);
  } catch (...) {
    Py_DECREF(x);
    throw;
  }
  // An in-place operator changes a set in place (a frozenset's makes a new one): on a set the trace owns only.
  // kiln._tracing.BINARY_OPS lists the in-place forms from index 13.
  const bool in_place = a->is(VarKind::kSet) && a->real_type == &PySet_Type && PySequence_Index(helper("BINARY_OPS"), op) >= 13;
  PyErr_Clear();  // not in the table: a comparison
  if (in_place && a->source) {
    Py_DECREF(x);
    Py_DECREF(y);
    claim(a, "an in-place operator");
  }
  PyObject* r = PyObject_CallFunctionObjArgs(op, x, y, nullptr);
  Py_DECREF(x);
  Py_DECREF(y);
  if (!r) raise_pending("set operator");
  if (a->is(VarKind::kSet) && r == a->value) {
    Py_DECREF(r);
    keys.refresh(a);
    return a;
  }
  if (PyAnySet_CheckExact(r)) return keys.make(r);
  return make_const_steal(r);
}

}  // namespace kiln::trace
