// Records in traced code: namedtuples, structseqs (torch.return_types: torch.max(x, 1), x.sort()),
// dataclasses and HuggingFace-style ModelOutput (an OrderedDict subclass that is also a dataclass).
//
// Typed tuples are kTuple Vars whose real_type is their class: indexing, unpacking and field reads
// (`.values`, `.indices`) go to the items, and the frame's output rebuilds the same class around the
// graph's real tensors. A record class (a dataclass) called in traced code becomes a kObject: the
// instance is built once on the trace-time values (fakes for tensors) so that attribute reads, item
// reads and read-only methods see exactly what eager's instance would hold, and the output calls the
// class again with the real values, as the traced code did, so __init__ and __post_init__ run as in eager.
#include "common/error.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

std::string str_of(PyObject* name) { return PyUnicode_AsUTF8(name); }

bool in_set(PyObject* set, PyObject* item) {
  int r = PySet_Contains(set, item);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

}  // namespace

PyObject* Tracer::tuple_fields(PyTypeObject* type) {
  if (type == &PyTuple_Type) return nullptr;
  PyObject* fields = PyObject_CallOneArg(helper("tuple_fields"), (PyObject*)type);
  if (!fields) rethrow_python("reading the fields of " + std::string(type->tp_name));
  if (fields == Py_None) {
    Py_DECREF(fields);
    return nullptr;
  }
  return fields;
}

VarPtr Tracer::construct_record(PyObject* cls, std::vector<VarPtr> args, const KwArgs& kwargs, bool* handled) {
  *handled = false;
  if (!PyType_Check(cls)) return nullptr;
  PyObject* kind = PyObject_CallOneArg(helper("record_class_kind"), cls);
  if (!kind) rethrow_python("classifying a class");
  if (kind == Py_None) {
    Py_DECREF(kind);
    return nullptr;
  }
  bool typed_tuple = PyUnicode_CompareWithASCIIString(kind, "tuple") == 0;
  Py_DECREF(kind);
  *handled = true;
  const std::string class_name = ((PyTypeObject*)cls)->tp_name;

  size_t npositional = args.size();
  std::vector<PyObject*> kwnames;
  for (const auto& [name, value] : kwargs) {
    Py_INCREF(name);
    kwnames.push_back(name);
    args.push_back(value);
  }
  PyObject* built_from = PyTuple_New(args.size());
  PyObject* names = PyTuple_New(kwnames.size());
  for (size_t i = 0; i < kwnames.size(); ++i) PyTuple_SET_ITEM(names, i, Py_NewRef(kwnames[i]));
  // Owns every new reference until the Var takes them.
  struct Release {
    PyObject* built_from;
    PyObject* names;
    std::vector<PyObject*>& kwnames;
    bool keep_kwnames = false;
    ~Release() {
      Py_DECREF(built_from);
      Py_DECREF(names);
      if (!keep_kwnames)
        for (PyObject* k : kwnames) Py_DECREF(k);
    }
  } release{built_from, names, kwnames};
  for (size_t i = 0; i < args.size(); ++i) {
    // An object made in the trace (a cache in a ModelOutput) stands in as an instance holding its attributes'
    // trace-time values: found again by identity in built_from, its reads map back to its Var (record_value).
    PyObject* item = args[i]->is(VarKind::kUserObject) ? user_object_standin(args[i]) : to_python(args[i]);
    if (!item) rethrow_python("converting an argument of " + class_name);
    PyTuple_SET_ITEM(built_from, i, item);
  }
  // The hook is off while tracing, so __init__/__post_init__ run as plain Python on the fakes.
  PyObject* instance = PyObject_Vectorcall(cls, PySequence_Fast_ITEMS(built_from), npositional,
                                           kwnames.empty() ? nullptr : names);
  if (!instance) rethrow_python("building a " + class_name + " on fake tensors");
  VarPtr object = make_object(instance, args, kwnames, built_from);
  release.keep_kwnames = true;
  Py_DECREF(instance);
  if (!typed_tuple) return object;
  if (!PyTuple_Check(object->value)) KILN_UNSUPPORTED() << class_name << "(...) did not return a tuple";
  std::vector<VarPtr> items;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(object->value); ++i)
    items.push_back(record_value(object, PyTuple_GET_ITEM(object->value, i)));
  return make_typed_tuple(Py_TYPE(object->value), std::move(items));
}

VarPtr Tracer::record_value(const VarPtr& obj, PyObject* value) {
  if (obj->built_from) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj->built_from); ++i)
      if (PyTuple_GET_ITEM(obj->built_from, i) == value) return obj->items[i];
  }
  if (PyTuple_Check(value) || PyList_Check(value)) {
    PyObject* fields = PyTuple_CheckExact(value) || PyList_CheckExact(value) ? nullptr : tuple_fields(Py_TYPE(value));
    if (fields || PyTuple_CheckExact(value) || PyList_CheckExact(value)) {
      Py_XDECREF(fields);
      std::vector<VarPtr> items;
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); ++i)
        items.push_back(record_value(obj, PySequence_Fast_GET_ITEM(value, i)));
      if (PyList_CheckExact(value)) return make_sequence(VarKind::kList, std::move(items));
      return make_typed_tuple(fields ? Py_TYPE(value) : nullptr, std::move(items));
    }
  }
  return wrap_result(value);
}

VarPtr Tracer::record_attr(const VarPtr& obj, PyObject* name) {
  PyTypeObject* type = obj->real_type;
  if (obj->is(VarKind::kTuple)) {
    PyObject* fields = tuple_fields(type);
    for (Py_ssize_t i = 0; fields && i < PyTuple_GET_SIZE(fields); ++i) {
      int eq = PyUnicode_Compare(PyTuple_GET_ITEM(fields, i), name);
      if (eq == 0 && i < (Py_ssize_t)obj->items.size()) {
        Py_DECREF(fields);
        return obj->items[i];
      }
    }
    Py_XDECREF(fields);
    PyObject* descr = _PyType_Lookup(type, name);
    if (descr && (PyFunction_Check(descr) || Py_TYPE(descr) == &PyMethodDescr_Type)) return make_method(descr, obj);
    // Plain class attributes (a namedtuple's _fields): values, not descriptors.
    if (descr && !Py_TYPE(descr)->tp_descr_get) return make_const(descr);
    KILN_UNSUPPORTED() << "attribute ." << str_of(name) << " of a " << obj->describe();
  }
  KILN_ASSERT(obj->is(VarKind::kObject)) << "record_attr on a " << obj->describe();
  PyObject* descr = _PyType_Lookup(type, name);
  if (descr && Py_TYPE(descr) == &PyProperty_Type) {
    // Traced like any function of the record, so tensor work in the getter is recorded.
    PyObject* getter = PyObject_GetAttrString(descr, "fget");
    if (!getter) rethrow_python("property.fget");
    VarPtr fget = make_const_steal(getter);
    return call(fget, {obj}, {});
  }
  PyObject** dictptr = _PyObject_GetDictPtr(obj->value);
  PyObject* own = dictptr && *dictptr ? PyDict_GetItemWithError(*dictptr, name) : nullptr;
  if (PyErr_Occurred()) rethrow_python("reading an attribute");
  if (!own && descr && (PyFunction_Check(descr) || Py_TYPE(descr) == &PyMethodDescr_Type))
    return make_method(descr, obj);
  PyObject* value = PyObject_GetAttr(obj->value, name);
  if (!value) rethrow_python("getattr " + str_of(name) + " of a " + obj->describe());
  VarPtr out = record_value(obj, value);
  Py_DECREF(value);
  return out;
}

VarPtr Tracer::call_record_method(const VarPtr& obj, PyObject* name, const std::vector<VarPtr>& args) {
  if (!in_set(helper("RECORD_READ_METHODS"), name))
    KILN_UNSUPPORTED() << "method " << str_of(name) << " of a " << obj->describe()
                       << " (only reading a record built in the traced code is traced)";
  PyObject* method = PyObject_GetAttr(obj->value, name);
  if (!method) rethrow_python("method " + str_of(name));
  PyObject* py_args = PyTuple_New(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* a = to_python(args[i]);
    if (!a) {
      Py_DECREF(method);
      Py_DECREF(py_args);
      rethrow_python("converting an argument");
    }
    PyTuple_SET_ITEM(py_args, i, a);
  }
  PyObject* result = PyObject_Call(method, py_args, nullptr);
  Py_DECREF(method);
  Py_DECREF(py_args);
  if (!result) rethrow_python(str_of(name) + "() of a " + obj->describe());
  // Views (keys(), values(), items()) would keep the trace-time instance alive inside a constant: lists.
  if (PyDictKeys_Check(result) || PyDictValues_Check(result) || PyDictItems_Check(result))
    Py_SETREF(result, PySequence_List(result));
  if (!result) rethrow_python("listing a dict view");
  VarPtr out = record_value(obj, result);
  Py_DECREF(result);
  return out;
}

VarPtr Tracer::frame_record_item(const VarPtr& obj, PyObject* index) {
  PyObject* kind = PyObject_CallOneArg(helper("record_class_kind"), (PyObject*)Py_TYPE(obj->value));
  if (!kind) rethrow_python("classifying a class");
  bool record = PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "object") == 0;
  Py_DECREF(kind);
  if (!record || !PyDict_Check(obj->value)) return nullptr;
  // The record's own __getitem__ (out[0] of a ModelOutput is its first non-None field) says which item;
  // the key it is stored under says how to reach it on later calls, under a guard on the keys (and on
  // the type, already there): same type and same keys give the same key for `index`.
  PyObject* item = PyObject_GetItem(obj->value, index);
  if (!item) rethrow_python("subscript of a " + std::string(Py_TYPE(obj->value)->tp_name));
  PyObject* keys = PyList_New(0);
  PyObject* found = nullptr;
  Py_ssize_t pos = 0;
  PyObject *k, *v;
  while (PyDict_Next(obj->value, &pos, &k, &v)) {
    PyList_Append(keys, k);
    if (!found && v == item && PyUnicode_CheckExact(k)) found = k;
  }
  VarPtr out;
  if (found) {
    PyObject* key_tuple = PyList_AsTuple(keys);
    guards_->add_dict_keys(obj->source, key_tuple);
    Py_DECREF(key_tuple);
    out = wrap(item, Source::dict_key(obj->source, str_of(found)));
  }
  Py_DECREF(keys);
  Py_DECREF(item);
  return out;
}

}  // namespace kiln::trace
