// Tracer: operators, subscripts, truth and iteration of traced values (the rest of Tracer is in tracer.cpp).

#include <optional>

#include "common/error.h"
#include "common/log.h"
#include "trace/interpreter.h"
#include "trace/traced_raise.h"
#include "trace/tracer.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

using detail::check;
using detail::is_module;
using detail::is_module_list;
using detail::is_tensor;
using detail::str_of;

// ---- operators ---------------------------------------------------------------------------------------

namespace {
// A class, or one of typing's special forms and aliases (List, Optional, Union[...]): what a type expression
// subscripts.
bool is_type_expression(PyObject* o, PyObject* typing_types) {
  if (PyType_Check(o)) return true;
  const int typing = PyObject_IsInstance(o, typing_types);
  if (typing < 0) PyErr_Clear();
  return typing == 1;
}
PyTypeObject* torch_size_type() {
  static PyTypeObject* t = [] {
    PyObject* torch = PyImport_ImportModule("torch");
    PyObject* size = torch ? PyObject_GetAttrString(torch, "Size") : nullptr;
    Py_XDECREF(torch);
    PyErr_Clear();
    return (PyTypeObject*)size;
  }();
  return t;
}

// A torch.Size, traced (x.shape, x.size()[:-1]) or constant: what `+` and `*` with it give (torch.Size's own).
bool is_torch_size(const VarPtr& v) {
  return (v->is(VarKind::kTuple) && v->real_type && v->real_type == torch_size_type()) ||
         (v->is(VarKind::kConst) && v->value && Py_TYPE(v->value) == torch_size_type());
}

bool op_is(PyObject* op, const char* name) {
  static PyObject* module = PyImport_ImportModule("operator");
  PyObject* f = module ? PyObject_GetAttrString(module, name) : nullptr;
  PyErr_Clear();
  Py_XDECREF(f);  // (the module keeps it alive)
  return f && f == op;
}

}  // namespace

VarPtr Tracer::binary(PyObject* op, const VarPtr& a, const VarPtr& b) {
  if (a->is(VarKind::kTensor) || b->is(VarKind::kTensor)) return call_recorded(op, {a, b}, {});
  if (VarPtr r = set_binary(op, a, b)) return r;
  if (SymbolicInts* symbolic = this->symbolic()) {
    if (a->is(VarKind::kSymInt) || b->is(VarKind::kSymInt))
      if (VarPtr r = symbolic->binary(op, a, b)) return r;
    if (holds_symbolic_int(a) || holds_symbolic_int(b))
      if (VarPtr r = symbolic->compare_tuples(op, a, b)) return r;
  }
  // Sequences holding size symbols (`x.size()[:-1] + (n,)`) are concatenated or repeated item by item below:
  // computed in Python, their sizes would be pinned.
  auto plain_count = [](const VarPtr& v) { return v->is(VarKind::kConst) && PyLong_CheckExact(v->value); };
  const bool symbolic_sequences =
      (holds_symbolic_int(a) || holds_symbolic_int(b)) &&
      (a->is(VarKind::kTuple) || a->is(VarKind::kList) || b->is(VarKind::kTuple) || b->is(VarKind::kList)) &&
      (op_is(op, "add") || op_is(op, "iadd") || (op_is(op, "mul") && (plain_count(a) || plain_count(b))));
  if (is_constant(a) && is_constant(b) && !symbolic_sequences) {
    PyObject* x = to_python(a);
    PyObject* y = to_python(b);
    PyObject* r = (x && y) ? PyObject_CallFunctionObjArgs(op, x, y, nullptr) : nullptr;
    Py_XDECREF(x);
    Py_XDECREF(y);
    check(r, "constant operator");
    VarPtr out = wrap_result(r);
    Py_DECREF(r);
    return out;
  }
  // Structural tuple/list concatenation keeps tensors symbolic.
  PyObject* add = PyObject_GetAttrString(helpers_, "BINARY_OPS");
  PyObject* add_fn = add ? PyList_GetItem(add, 0) : nullptr;
  PyObject* iadd_fn = add ? PyList_GetItem(add, 13) : nullptr;
  PyObject* mul_fn = add ? PyList_GetItem(add, 5) : nullptr;
  Py_XDECREF(add);
  if ((a->is(VarKind::kList) && a->real_type) || (b->is(VarKind::kList) && b->real_type))
    KILN_UNSUPPORTED() << "operator on a " << (is_dict_view(a) || is_dict_view(b) ? "dict view" : "slice of a ModuleList");
  // Repetition, `(x,) * n` and `[x] * n` with n a constant: the items n times over (the same Vars, as eager's
  // repetition repeats references).
  if (op == mul_fn) {
    const bool count_after = b->is(VarKind::kConst) && PyLong_CheckExact(b->value);
    const VarPtr& seq = count_after ? a : b;
    const VarPtr& count = count_after ? b : a;
    const bool sequence = seq->is(VarKind::kTuple) || (seq->is(VarKind::kList) && !seq->real_type);
    if (sequence && count->is(VarKind::kConst) && PyLong_CheckExact(count->value)) {
      const long long n = PyLong_AsLongLong(count->value);
      if (n < 0 && PyErr_Occurred()) rethrow_python("sequence repetition");
      std::vector<VarPtr> items;
      for (long long k = 0; k < n; ++k) items.insert(items.end(), seq->items.begin(), seq->items.end());
      VarPtr out = make_sequence(seq->kind, std::move(items));
      if (is_torch_size(seq)) out->real_type = torch_size_type();
      return out;
    }
  }
  if (op == add_fn || op == iadd_fn) {
    // Tuples, traced or constant (`(output,) + outputs` with `outputs = ()`): a new tuple of their items.
    auto tuple_items = [](const VarPtr& v) -> std::optional<std::vector<VarPtr>> {
      if (v->is(VarKind::kTuple)) return v->items;
      if (!v->is(VarKind::kConst) || !(PyTuple_CheckExact(v->value) || is_torch_size(v))) return std::nullopt;
      std::vector<VarPtr> items;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v->value); ++i) items.push_back(make_const(PyTuple_GET_ITEM(v->value, i)));
      return items;
    };
    std::optional<std::vector<VarPtr>> head = tuple_items(a), tail = tuple_items(b);
    if (head && tail) {
      head->insert(head->end(), tail->begin(), tail->end());
      VarPtr out = make_sequence(VarKind::kTuple, std::move(*head));
      if (is_torch_size(a) || is_torch_size(b)) out->real_type = torch_size_type();
      return out;
    }
    if (a->is(VarKind::kList) && b->is(VarKind::kList)) {
      std::vector<VarPtr> items = a->items;
      items.insert(items.end(), b->items.begin(), b->items.end());
      if (op == iadd_fn && !a->real_type && claim_container(a)) {  // in place, as list.__iadd__
        a->items = items;
        return a;
      }
      return make_sequence(VarKind::kList, std::move(items));
    }
  }
  KILN_UNSUPPORTED() << "operator on " << a->describe() << " and " << b->describe();
}

VarPtr Tracer::subscript(const VarPtr& obj, const VarPtr& index) {
  if (obj->is(VarKind::kConst) && !obj->by_type && obj->value && is_constant(index) &&
      is_type_expression(obj->value, helper("TYPING_TYPES"))) {
    // A type expression (`List[torch.Tensor]` for torch.jit.annotate, `tuple[int, ...]`): typing's objects and
    // classes subscripted by constants are values made once (typing caches them), computed at trace time.
    PyObject* key = to_python(index);
    PyObject* r = key ? PyObject_GetItem(obj->value, key) : nullptr;
    Py_XDECREF(key);
    if (!r) raise_pending("subscripting a type");
    return make_const_steal(r);
  }
  if (obj->is(VarKind::kUserObject)) {
    VarPtr getitem = python_special_method(obj, "__getitem__");
    if (!getitem) KILN_UNSUPPORTED() << "subscript of a " << obj->describe() << " (its class has no Python __getitem__)";
    return call(getitem, {index}, {});
  }
  if (!obj->is(VarKind::kTensor) && index->is(VarKind::kSlice) && is_constant(index)) {
    // A slice by sizes of a Python sequence: its items are taken at trace time (the bounds pinned).
    PyObject* constant = to_python(index);
    if (!constant) rethrow_python("slice");
    return subscript(obj, make_const_steal(constant));
  }
  if (obj->is(VarKind::kTensor) || index->is(VarKind::kTensor)) {
    static PyObject* getitem = nullptr;
    if (!getitem) {
      PyObject* op = PyImport_ImportModule("operator");
      getitem = PyObject_GetAttrString(op, "getitem");
      Py_DECREF(op);
    }
    return call_recorded(getitem, {obj, index}, {});
  }
  if (is_dict_view(obj)) {
    PyErr_Format(PyExc_TypeError, "'%s' object is not subscriptable", obj->real_type->tp_name);
    raise_pending("indexing");
  }
  if ((obj->is(VarKind::kTuple) || obj->is(VarKind::kList)) && index->is(VarKind::kConst)) {
    PyObject* i = index->value;
    if (PyLong_Check(i)) {
      long long k = PyLong_AsLongLong(i);
      long long n = (long long)obj->items.size();
      if (k < 0) k += n;
      if (k < 0 || k >= n) {
        // A sequence made in the trace has the length it has here, as in eager.
        if (obj->source) KILN_UNSUPPORTED() << "index out of range";
        PyErr_SetString(PyExc_IndexError, obj->is(VarKind::kTuple) ? "tuple index out of range" : "list index out of range");
        raise_pending("indexing");
      }
      return obj->items[k];
    }
    if (PySlice_Check(i)) {
      Py_ssize_t start, stop, step, len;
      if (PySlice_GetIndicesEx(i, obj->items.size(), &start, &stop, &step, &len) < 0) rethrow_python("slice");
      std::vector<VarPtr> items;
      for (Py_ssize_t k = 0, j = start; k < len; ++k, j += step) items.push_back(obj->items[j]);
      VarPtr out = make_sequence(obj->kind, std::move(items));
      out->real_type = obj->real_type;  // a slice of a ModuleList's slice is one too
      return out;
    }
  }
  if (obj->is(VarKind::kDict) && index->is(VarKind::kConst)) {
    for (size_t k = 0; k < obj->keys.size(); ++k) {
      int eq = PyObject_RichCompareBool(obj->keys[k], index->value, Py_EQ);
      if (eq == 1) return obj->items[k];
    }
    if (obj->real_type == detail::default_dict_type() && obj->value && obj->value != Py_None && !index->by_type) {
      // A defaultdict made in the trace: the missing key gets default_factory() (a constant callable), as __missing__.
      VarPtr made = call(make_const(obj->value), {}, {});
      obj->keys.push_back(Py_NewRef(index->value));
      obj->items.push_back(made);
      return made;
    }
    // A dict made in the trace holds exactly its keys here, as in eager; one read from outside is guarded on its
    // keys (Tracer::wrap), so the key is missing on every call these guards let through. The KeyError goes to the
    // traced code's handler (Mapping.get's `except KeyError`), or becomes a graph break where eager raises it.
    PyErr_SetObject(PyExc_KeyError, index->value);
    raise_pending("looking up a dict key");
  }
  if (obj->is(VarKind::kModule) && index->is(VarKind::kConst) && PySlice_Check(index->value) &&
      is_module_list(obj->value)) {
    // `self.layers[:n]` (HF's decoder loops): eager makes a new ModuleList of those children. Here a list of the
    // children, each reached through _modules as iteration reaches it (guarded on the ModuleList's keys), typed
    // ModuleList for isinstance and type(); made into a real ModuleList wherever it leaves the trace.
    std::vector<VarPtr> children = iterate(obj);
    VarPtr out = subscript(make_sequence(VarKind::kList, std::move(children)), index);
    out->real_type = Py_TYPE(obj->value);
    return out;
  }
  if (obj->is(VarKind::kModule) && index->is(VarKind::kConst)) {
    // ModuleList/Sequential/ModuleDict/ParameterList/ParameterDict indexing: the child through the slot and key the
    // index names (_tracing.container_slot). A position is guarded on the container's keys or size (an append keeps
    // `_modules['2']`, but `[-1]` moves on; a Sequential's keys are names).
    PyObject* child = check(PyObject_GetItem(obj->value, index->value), "module indexing");
    SourcePtr source;
    if (obj->source) {
      PyObject* slot = PyObject_CallFunctionObjArgs(helper("container_slot"), obj->value, index->value, nullptr);
      if (!slot) {
        Py_DECREF(child);
        rethrow_python("locating a container's item");
      }
      if (slot != Py_None) {
        if (PyLong_Check(index->value)) guard_container_items(obj);
        source = Source::module_slot(obj->source, str_of(PyTuple_GET_ITEM(slot, 0)), str_of(PyTuple_GET_ITEM(slot, 1)));
      }
      Py_DECREF(slot);
    }
    if (!source && (is_module(child) || is_tensor(child))) {
      Py_DECREF(child);
      KILN_UNSUPPORTED() << "indexing a " << Py_TYPE(obj->value)->tp_name << " whose item is not reached through its "
                         << "_modules or _parameters";
    }
    VarPtr out = source ? wrap(child, source) : wrap_result(child);
    Py_DECREF(child);
    return out;
  }
  if (obj->is(VarKind::kObject) && is_constant(index)) {
    // out["logits"], out[0] of a ModelOutput: its own __getitem__ on the trace-time instance.
    PyObject* i = to_python(index);
    PyObject* r = i ? PyObject_GetItem(obj->value, i) : nullptr;
    Py_XDECREF(i);
    check(r, "subscript of a " + obj->describe());
    VarPtr out = record_value(obj, r);
    Py_DECREF(r);
    return out;
  }
  if (obj->is(VarKind::kConst) && obj->by_type && obj->source && index->is(VarKind::kConst)) {
    if (VarPtr item = frame_record_item(obj, index->value)) return item;
  }
  if (index->is(VarKind::kConst))  // os.environ["X"]
    if (VarPtr read = call_environ_method(obj, "__getitem__", {index}, {})) return read;
  // An object from the frame pinned by its type only: its items are not guarded, and an item read here
  // would be a trace-time copy (a list stored into later would not be the frame's).
  if (obj->is(VarKind::kConst) && obj->by_type)
    KILN_UNSUPPORTED() << "subscript of a " << Py_TYPE(obj->value)->tp_name << " object (its items are not guarded)";
  if (is_constant(obj) && is_constant(index)) {
    PyObject* o = to_python(obj);
    PyObject* i = to_python(index);
    PyObject* r = (o && i) ? PyObject_GetItem(o, i) : nullptr;
    Py_XDECREF(o);
    Py_XDECREF(i);
    check(r, "constant subscript");
    VarPtr out = wrap_result(r);
    Py_DECREF(r);
    return out;
  }
  KILN_UNSUPPORTED() << "subscript of a " << obj->describe() << " by a " << index->describe();
}

namespace {
// Whether a type defines __bool__, and whether it defines __len__ (either is how Python decides its truth).
std::pair<bool, bool> bool_and_len_slots(PyTypeObject* t) {
  return {t->tp_as_number && t->tp_as_number->nb_bool,
          (t->tp_as_mapping && t->tp_as_mapping->mp_length) || (t->tp_as_sequence && t->tp_as_sequence->sq_length)};
}
}  // namespace

bool Tracer::truthy(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kSymInt: return symbolic_->truthy(v);
    case VarKind::kConst: {
      // An object pinned by type only (a deque, a user object): its truth is its state. A __bool__ or __len__
      // written in Python is traced (its reads carry their guards), a C length is guarded, others run in Python.
      if (v->by_type && v->source) {
        VarPtr test = python_special_method(v, "__bool__");
        if (!test) test = python_special_method(v, "__len__");
        if (test) return truthy(call(test, {}, {}));
      }
      int r = PyObject_IsTrue(v->value);
      if (r < 0) rethrow_python("truth value");
      if (v->by_type && v->source) {
        PyTypeObject* t = Py_TYPE(v->value);
        const auto [has_bool, has_len] = bool_and_len_slots(t);
        if (has_bool || (has_len && (t->tp_flags & Py_TPFLAGS_HEAPTYPE)))
          KILN_UNSUPPORTED() << "truth value of a " << t->tp_name << " (its __bool__ or __len__ is not traced)";
        if (has_len) {
          Py_ssize_t n = PyObject_Length(v->value);
          if (n < 0) rethrow_python("len");
          guards_->add_length(v->source, n);
        }
      }
      return r;
    }
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kDict:
    case VarKind::kSet: return !v->items.empty();
    case VarKind::kModule: {
      // `if self.extra:` of a ModuleList is its length: guarded as iteration guards it. A module without __bool__
      // or __len__ is always true (its class is guarded); any other's are not traced.
      const auto [has_bool, has_len] = bool_and_len_slots(Py_TYPE(v->value));
      if (has_bool || has_len) guard_container_items(v);
      [[fallthrough]];
    }
    case VarKind::kObject: {
      int r = PyObject_IsTrue(v->value);
      if (r < 0) rethrow_python("truth value of a " + v->describe());
      return r;
    }
    case VarKind::kMethod: return true;
    case VarKind::kUserObject: {
      // As CPython: __bool__, else __len__, else true (a class with a C one is not plain).
      VarPtr test = python_special_method(v, "__bool__");
      if (!test) test = python_special_method(v, "__len__");
      return test ? truthy(call(test, {}, {})) : true;
    }
    case VarKind::kTensor:
      KILN_UNSUPPORTED() << "control flow depends on a tensor's value (bool(tensor)): data-dependent branch";
    default: break;
  }
  KILN_UNSUPPORTED() << "truth value of a " << v->describe();
}

std::string Tracer::guard_container_items(const VarPtr& v) {
  // As the container's own __iter__ (kiln._tracing.module_iteration): Sequential and ModuleList yield their
  // children in _modules order, ModuleDict and ParameterDict their keys, ParameterList self[i] for each index.
  // Any other module's __iter__ (and __len__) is not traced.
  PyObject* how = check(PyObject_CallOneArg(helper("module_iteration"), v->value), "classifying a module's __iter__");
  const std::string kind = how == Py_None ? "" : str_of(how);
  Py_DECREF(how);
  if (kind.empty()) KILN_UNSUPPORTED() << "iterating a " << Py_TYPE(v->value)->tp_name << " (its __iter__ is not traced)";
  // What the trace reads of the items (a loop runs once per item; len()) is guarded on the container's own
  // record of them: the _modules or _keys dict's keys in order, ParameterList's _size.
  if (!v->source) return kind;
  if (kind == "indexed") {
    PyObject* size = check(PyObject_GetAttrString(v->value, "_size"), "ParameterList._size");
    guards_->add_constant(Source::instance_dict(v->source, "_size"), size);
    Py_DECREF(size);
    return kind;
  }
  const char* dict_name = kind == "keys" && PyObject_HasAttrString(v->value, "_keys") ? "_keys" : "_modules";
  PyObject* dict = check(PyObject_GetAttrString(v->value, dict_name), "a module's key dict");
  PyObject* keys = PyDict_Check(dict) ? PySequence_Tuple(dict) : nullptr;
  Py_DECREF(dict);
  if (!keys) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "iterating a " << Py_TYPE(v->value)->tp_name << " whose " << dict_name << " is not a dict";
  }
  guards_->add_dict_keys(Source::instance_dict(v->source, dict_name), keys);
  Py_DECREF(keys);
  return kind;
}

std::vector<VarPtr> Tracer::iterate(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kSet: return v->items;
    case VarKind::kDict: {
      std::vector<VarPtr> keys;
      for (PyObject* k : v->keys) keys.push_back(make_const(k));
      return keys;
    }
    case VarKind::kIterator: return std::vector<VarPtr>(v->items.begin() + v->position, v->items.end());
    case VarKind::kGenerator: {  // consumed whole (tuple(), list(), unpacking, sum()...), as eager does
      constexpr size_t kMaxItems = 4096;  // a generator that never ends ends the trace instead
      std::vector<VarPtr> out;
      while (VarPtr item = generator_next(v)) {
        if (out.size() == kMaxItems) KILN_UNSUPPORTED() << "consuming a generator of more than " << kMaxItems << " items";
        out.push_back(std::move(item));
      }
      return out;
    }
    case VarKind::kModule: {
      const std::string kind = guard_container_items(v);  // the container's own __iter__, guarded
      std::vector<VarPtr> out;
      if (kind == "children") {  // through _modules, as an attribute read of each child would
        PyObject* modules = check(PyObject_GetAttrString(v->value, "_modules"), "module._modules");
        Py_ssize_t pos = 0;
        PyObject *k, *child;
        while (PyDict_Next(modules, &pos, &k, &child))
          out.push_back(wrap(child, v->source ? Source::module_slot(v->source, "_modules", str_of(k)) : nullptr));
        Py_DECREF(modules);
        return out;
      }
      PyObject* items = check(PySequence_List(v->value), "iterating a " + v->describe());
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); ++i)
        out.push_back(kind == "keys" ? wrap_result(PyList_GET_ITEM(items, i))
                                     : subscript(v, make_const_steal(PyLong_FromSsize_t(i))));
      Py_DECREF(items);
      return out;
    }
    case VarKind::kUserObject: {
      VarPtr dunder_iter = python_special_method(v, "__iter__");
      if (!dunder_iter) KILN_UNSUPPORTED() << "iterating a " << v->describe() << " (its class has no Python __iter__)";
      return iterate(call(dunder_iter, {}, {}));
    }
    case VarKind::kObject: {
      PyObject* seq = PySequence_List(v->value);
      check(seq, "iterating a " + v->describe());
      std::vector<VarPtr> out;
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); ++i) out.push_back(record_value(v, PyList_GET_ITEM(seq, i)));
      Py_DECREF(seq);
      return out;
    }
    case VarKind::kConst: {
      // Iterating a live iterator (a generator, a file) at trace time would consume it: eager must.
      if (PyIter_Check(v->value)) KILN_UNSUPPORTED() << "iterating a " << Py_TYPE(v->value)->tp_name << " (an iterator)";
      // An object from the frame pinned by its type only: what it yields is neither known nor guarded.
      if (v->by_type)
        KILN_UNSUPPORTED() << "iterating a " << Py_TYPE(v->value)->tp_name << " object (its items are not guarded)";
      PyObject* seq = PySequence_List(v->value);
      check(seq, "iterating a constant");
      std::vector<VarPtr> out;
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); ++i) out.push_back(wrap_result(PyList_GET_ITEM(seq, i)));
      Py_DECREF(seq);
      return out;
    }
    case VarKind::kTensor: {
      PyObject* fake = v->value;
      PyObject* shape = check(PyObject_GetAttrString(fake, "shape"), "shape");
      Py_ssize_t n = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0
                         ? PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0))
                         : -1;
      Py_DECREF(shape);
      if (n < 0) KILN_UNSUPPORTED() << "iterating a 0-d tensor";
      std::vector<VarPtr> out;
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* idx = PyLong_FromSsize_t(i);
        out.push_back(subscript(v, make_const_steal(idx)));
      }
      return out;
    }
    default: break;
  }
  KILN_UNSUPPORTED() << "iterating a " << v->describe();
}

}  // namespace kiln::trace
