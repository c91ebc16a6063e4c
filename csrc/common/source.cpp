#include "common/source.h"

#include "common/error.h"

namespace kiln {

namespace {
// Paths longer than this are refused where they are made. Describing, resolving and freeing a source walk its
// chain recursively, and a loop like `o = o.__dir__` unrolled by the tracer would otherwise build a chain
// tens of thousands deep and overflow the C stack (CPython's test_trashcan_recursion did).
constexpr int kMaxSourceDepth = 256;
}  // namespace

Source::Source(SourceKind kind, SourcePtr base, std::string name, long long index, std::string slot)
    : kind_(kind), base_(std::move(base)), name_(std::move(name)), slot_(std::move(slot)), index_(index),
      depth_(base_ ? base_->depth_ + 1 : 0) {
  if (depth_ > kMaxSourceDepth)
    KILN_UNSUPPORTED() << "a value reached through more than " << kMaxSourceDepth << " attribute or item steps";
  if (!name_.empty()) py_name_ = PyUnicode_InternFromString(name_.c_str());
  if (!slot_.empty()) py_slot_ = PyUnicode_InternFromString(slot_.c_str());
}

Source::~Source() {
  // Sources die with cache entries, which are freed with the GIL held (frame/ and kiln.reset()).
  Py_XDECREF(py_name_);
  Py_XDECREF(py_slot_);
  Py_XDECREF(object_);
}


SourcePtr Source::local(int index, std::string name) {
  return SourcePtr(new Source(SourceKind::kLocal, nullptr, std::move(name), index));
}
SourcePtr Source::free(int index, std::string name) {
  return SourcePtr(new Source(SourceKind::kFree, nullptr, std::move(name), index));
}
SourcePtr Source::global(std::string name) {
  return SourcePtr(new Source(SourceKind::kGlobal, nullptr, std::move(name), 0));
}
SourcePtr Source::builtin(std::string name) {
  return SourcePtr(new Source(SourceKind::kBuiltin, nullptr, std::move(name), 0));
}
SourcePtr Source::attr(SourcePtr base, std::string name) {
  return SourcePtr(new Source(SourceKind::kAttr, std::move(base), std::move(name), 0));
}
SourcePtr Source::instance_dict(SourcePtr base, std::string name) {
  return SourcePtr(new Source(SourceKind::kInstanceDict, std::move(base), std::move(name), 0));
}
SourcePtr Source::module_slot(SourcePtr base, std::string slot, std::string name) {
  return SourcePtr(new Source(SourceKind::kModuleSlot, std::move(base), std::move(name), 0, std::move(slot)));
}
SourcePtr Source::index(SourcePtr base, long long i) {
  return SourcePtr(new Source(SourceKind::kIndex, std::move(base), "", i));
}
SourcePtr Source::dict_key(SourcePtr base, std::string key) {
  return SourcePtr(new Source(SourceKind::kDictKey, std::move(base), std::move(key), 0));
}

SourcePtr Source::dict_item(SourcePtr base, PyObject* key) {
  if (PyUnicode_CheckExact(key)) return dict_key(std::move(base), PyUnicode_AsUTF8(key));
  PyObject* text = PyObject_Repr(key);
  std::string label = text ? PyUnicode_AsUTF8(text) : "?";
  Py_XDECREF(text);
  auto* s = new Source(SourceKind::kDictKey, std::move(base), "", 0);
  s->name_ = std::move(label);  // describe() only: lookups use the key object itself
  s->py_name_ = Py_NewRef(key);
  return SourcePtr(s);
}

bool Source::is_plain_key(PyObject* key) {
  if (PyUnicode_CheckExact(key) || PyLong_CheckExact(key) || PyBool_Check(key) || key == Py_None) return true;
  // Keys compared by identity: classes (a registry keyed by type), and objects that keep object's own hash and
  // equality and are singletons: without an instance dict (typing.Union, object() sentinels), or pickled by name
  // (`__reduce__` returns a str, as typing.Literal's does). Other objects with an instance dict (modules, user
  // objects) are left out: a source holds its key, and guards must not keep a model alive.
  PyTypeObject* t = Py_TYPE(key);
  if (PyType_Check(key)) return t->tp_hash == PyType_Type.tp_hash && t->tp_richcompare == PyType_Type.tp_richcompare;
  if (t->tp_hash != PyBaseObject_Type.tp_hash || t->tp_richcompare != PyBaseObject_Type.tp_richcompare) return false;
  if (t->tp_dictoffset == 0) return true;
  // Only a class that defines its own __reduce__ is asked (object's would copy the instance's state to answer).
  static PyObject* reduce_name = PyUnicode_InternFromString("__reduce__");
  if (_PyType_Lookup(t, reduce_name) == _PyType_Lookup(&PyBaseObject_Type, reduce_name)) return false;
  PyObject* reduced = PyObject_CallMethod(key, "__reduce__", nullptr);
  const bool by_name = reduced && PyUnicode_Check(reduced);
  Py_XDECREF(reduced);
  if (!reduced) PyErr_Clear();
  return by_name;
}

SourcePtr Source::mapping_get(SourcePtr base, std::string key) {
  return SourcePtr(new Source(SourceKind::kMappingGet, std::move(base), std::move(key), 0));
}

SourcePtr Source::call(SourcePtr base) {
  return SourcePtr(new Source(SourceKind::kCall, std::move(base), "", 0));
}

SourcePtr Source::call_raises(SourcePtr base) {
  return SourcePtr(new Source(SourceKind::kCallRaises, std::move(base), "", 0));
}

SourcePtr Source::type_of(SourcePtr base) {
  return SourcePtr(new Source(SourceKind::kType, std::move(base), "", 0));
}

SourcePtr Source::object(PyObject* object, std::string label) {
  auto* s = new Source(SourceKind::kObject, nullptr, std::move(label), 0);
  Py_INCREF(object);
  s->object_ = object;
  return SourcePtr(s);
}

std::string Source::describe() const {
  switch (kind_) {
    case SourceKind::kLocal: return name_;
    case SourceKind::kFree: return name_;
    case SourceKind::kGlobal: return "G['" + name_ + "']";
    case SourceKind::kBuiltin: return "builtins['" + name_ + "']";
    case SourceKind::kAttr:
    case SourceKind::kInstanceDict:
    case SourceKind::kModuleSlot: return base_->describe() + "." + name_;
    case SourceKind::kIndex: return base_->describe() + "[" + std::to_string(index_) + "]";
    case SourceKind::kDictKey:
      return py_name_ && PyUnicode_CheckExact(py_name_) ? base_->describe() + "['" + name_ + "']"
                                                        : base_->describe() + "[" + name_ + "]";
    case SourceKind::kObject: return name_;
    case SourceKind::kType: return "type(" + base_->describe() + ")";
    case SourceKind::kMappingGet: return base_->describe() + ".get('" + name_ + "')";
    case SourceKind::kCall: return base_->describe() + "()";
    case SourceKind::kCallRaises: return "type of what " + base_->describe() + "() raises";
  }
  return "?";
}

namespace {
// Borrowed dict lookup that turns a miss into a KeyError-like AttributeError.
PyObject* dict_get_new(PyObject* dict, PyObject* key, const char* what) {
  if (!dict || !PyDict_Check(dict)) {
    PyErr_Format(PyExc_AttributeError, "kiln source: %s is not reachable", what);
    return nullptr;
  }
  PyObject* v = PyDict_GetItemWithError(dict, key);
  if (!v) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%U", key);
    return nullptr;
  }
  Py_INCREF(v);
  return v;
}
}  // namespace

PyObject* Source::resolve_from(PyObject* base, const SourceRoots& roots) const {
  switch (kind_) {
    case SourceKind::kAttr: return PyObject_GetAttr(base, py_name_);
    case SourceKind::kInstanceDict: {
      PyObject** dictptr = _PyObject_GetDictPtr(base);
      if (!dictptr || !*dictptr) return PyObject_GetAttr(base, py_name_);
      PyObject* v = PyDict_GetItemWithError(*dictptr, py_name_);
      if (!v) return PyErr_Occurred() ? nullptr : PyObject_GetAttr(base, py_name_);
      Py_INCREF(v);
      return v;
    }
    case SourceKind::kModuleSlot: {
      PyObject** dictptr = _PyObject_GetDictPtr(base);
      if (!dictptr || !*dictptr) return PyObject_GetAttr(base, py_name_);
      PyObject* slot = PyDict_GetItemWithError(*dictptr, py_slot_);
      if (!slot) return PyErr_Occurred() ? nullptr : PyObject_GetAttr(base, py_name_);
      return dict_get_new(slot, py_name_, "module slot");
    }
    case SourceKind::kIndex: {
      if (PyTuple_CheckExact(base)) {
        if (index_ < 0 || index_ >= PyTuple_GET_SIZE(base)) break;
        PyObject* v = PyTuple_GET_ITEM(base, index_);
        Py_INCREF(v);
        return v;
      }
      if (PyList_CheckExact(base)) {
        if (index_ < 0 || index_ >= PyList_GET_SIZE(base)) break;
        PyObject* v = PyList_GET_ITEM(base, index_);
        Py_INCREF(v);
        return v;
      }
      return PySequence_GetItem(base, index_);
    }
    case SourceKind::kDictKey:
      if (PyDict_Check(base)) return dict_get_new(base, py_name_, "dict");
      return PyObject_GetItem(base, py_name_);
    case SourceKind::kType: return Py_NewRef((PyObject*)Py_TYPE(base));
    case SourceKind::kMappingGet: return PyObject_CallMethod(base, "get", "O", py_name_);
    case SourceKind::kCall: return PyObject_CallNoArgs(base);
    case SourceKind::kCallRaises: {
      PyObject* answer = PyObject_CallNoArgs(base);
      if (answer) {
        Py_DECREF(answer);
        return Py_NewRef(Py_None);
      }
      PyObject* raised = PyErr_Occurred();
      PyObject* type = Py_NewRef(raised);
      PyErr_Clear();
      return type;
    }
    default: break;
  }
  PyErr_Format(PyExc_IndexError, "kiln source %s out of range", describe().c_str());
  return nullptr;
}

PyObject* Source::resolve(const SourceRoots& roots) const {
  switch (kind_) {
    case SourceKind::kLocal: {
      if (index_ >= roots.nlocals || !roots.locals[index_]) {
        PyErr_Format(PyExc_UnboundLocalError, "kiln source: local %s unbound", name_.c_str());
        return nullptr;
      }
      PyObject* v = roots.locals[index_];
      Py_INCREF(v);
      return v;
    }
    case SourceKind::kFree: {
      PyObject* v = nullptr;
      if (roots.freevars) {
        if (index_ < roots.nfreevars) v = roots.freevars[index_];
      } else if (roots.closure && index_ < PyTuple_GET_SIZE(roots.closure)) {
        v = PyCell_GET(PyTuple_GET_ITEM(roots.closure, index_));
      }
      if (!v) {
        PyErr_Format(PyExc_NameError, "kiln source: free variable %s unbound", name_.c_str());
        return nullptr;
      }
      Py_INCREF(v);
      return v;
    }
    case SourceKind::kGlobal: return dict_get_new(roots.globals, py_name_, "globals");
    case SourceKind::kBuiltin: return dict_get_new(roots.builtins, py_name_, "builtins");
    case SourceKind::kObject: Py_INCREF(object_); return object_;
    default: break;
  }
  PyObject* base = base_->resolve(roots);
  if (!base) return nullptr;
  PyObject* v = resolve_from(base, roots);
  Py_DECREF(base);
  return v;
}

SourceWalker::~SourceWalker() { truncate(0); }

void SourceWalker::truncate(size_t n) {
  while (path_.size() > n) {
    Py_DECREF(path_.back().second);
    path_.pop_back();
  }
}

PyObject* SourceWalker::resolve(const Source& source) {
  chain_.clear();
  for (const Source* s = &source; s; s = s->base().get()) chain_.push_back(s);
  // the longest prefix (from the root) already walked
  size_t shared = 0;
  while (shared < path_.size() && shared < chain_.size() && path_[shared].first->same_step(*chain_[chain_.size() - 1 - shared])) ++shared;
  truncate(shared);
  for (size_t i = shared; i < chain_.size(); ++i) {
    const Source* step = chain_[chain_.size() - 1 - i];
    PyObject* v = i == 0 ? step->resolve(roots_) : step->resolve_from(path_.back().second, roots_);
    if (!v) return nullptr;
    path_.emplace_back(step, v);
  }
  return Py_NewRef(path_.back().second);
}

}  // namespace kiln
