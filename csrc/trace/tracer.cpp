// Tracer: values entering the trace (guards), attribute access, results, and the trace driver.
#include "trace/tracer.h"

#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "frame/cpython_shim.h"  // KILN_RESUME_QUALNAME_MARKER
#include "trace/code_layout.h"
#include "trace/interpreter.h"
#include "trace/traced_raise.h"

namespace kiln::trace {

namespace {

// Turns a pending Python error into kiln's Unsupported (the frame then runs eagerly, where the same
// Python error, if it is one, is raised by CPython itself).
[[noreturn]] void throw_python_error(const std::string& context) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string message = context;
  if (value) {
    PyObject* s = PyObject_Str(value);
    if (s) {
      message += std::string(": ") + (type ? ((PyTypeObject*)type)->tp_name : "") + ": " + PyUnicode_AsUTF8(s);
      Py_DECREF(s);
    }
  }
  PyErr_Clear();
  // An Unsupported raised by the recorder keeps its own message.
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  KILN_UNSUPPORTED() << message;
}

PyObject* check(PyObject* o, const std::string& context) {
  if (!o) throw_python_error(context);
  return o;
}

// module.name, imported once and kept for the process.
PyObject* lookup_once(const char* module, const char* name) {
  PyObject* m = check(PyImport_ImportModule(module), std::string("import ") + module);
  PyObject* attr = check(PyObject_GetAttrString(m, name), std::string(module) + "." + name);
  Py_DECREF(m);
  return attr;
}

bool is_instance_of(PyObject* o, PyObject* type) {
  int r = PyObject_IsInstance(o, type);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

bool is_tensor(PyObject* o) {
  static PyObject* tensor_type = lookup_once("torch", "Tensor");
  return is_instance_of(o, tensor_type);
}

bool is_module(PyObject* o) {
  static PyObject* module_type = lookup_once("torch.nn", "Module");
  return is_instance_of(o, module_type);
}

bool is_module_list(PyObject* o) {
  static PyObject* module_list = lookup_once("torch.nn", "ModuleList");
  return (PyObject*)Py_TYPE(o) == module_list;
}

// Values compared by value in guards.
bool is_simple_constant(PyObject* o) {
  if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) ||
      PyBytes_CheckExact(o))
    return true;
  const char* tn = Py_TYPE(o)->tp_name;
  return std::string(tn) == "torch.dtype" || std::string(tn) == "torch.device" || std::string(tn) == "torch.Size" ||
         std::string(tn) == "torch.layout" || std::string(tn) == "torch.memory_format";
}

std::string str_of(PyObject* name) { return PyUnicode_AsUTF8(name); }

}  // namespace

TraceResult::~TraceResult() {
  Py_XDECREF(graph);
  Py_XDECREF(example_inputs);
}

Tracer::Tracer(const FrameInput& frame) : root_(frame), guards_(std::make_unique<guards::GuardTree>()) {
  helpers_ = check(PyImport_ImportModule("kiln._tracing"), "import kiln._tracing");
  PyObject* fake = check(PyImport_ImportModule("kiln._fake"), "import kiln._fake");
  recorder_ = PyObject_CallMethod(fake, "Recorder", nullptr);
  Py_DECREF(fake);
  check(recorder_, "kiln._fake.Recorder()");
  example_inputs_ = PyList_New(0);
  guards_->add_globals_identity(frame.globals);
  guards_->set_global_state(guards::GlobalState::current());
}

Tracer::~Tracer() {
  tensor_vars_.clear();
  for (PyObject* standin : standins_) Py_DECREF(standin);
  for (PendingStore& store : stores_) {
    Py_DECREF(store.owner);
    Py_DECREF(store.name);
  }
  Py_XDECREF(helpers_);
  Py_XDECREF(recorder_);
  Py_XDECREF(example_inputs_);
}

PyObject* Tracer::helper(const char* name) {
  PyObject* h = check(PyObject_GetAttrString(helpers_, name), std::string("kiln._tracing.") + name);
  Py_DECREF(h);  // kept alive by the module
  return h;
}

SourcePtr Tracer::global_source(PyObject* globals, PyObject* name) {
  if (globals == root_.globals) return Source::global(str_of(name));
  PyObject* module_name = PyDict_GetItemString(globals, "__name__");
  std::string label = module_name && PyUnicode_Check(module_name) ? str_of(module_name) : "<globals>";
  return Source::dict_key(Source::object(globals, "globals of " + label), str_of(name));
}

SourcePtr Tracer::builtin_source(PyObject* builtins, PyObject* name) {
  if (builtins == root_.builtins) return Source::builtin(str_of(name));
  return Source::dict_key(Source::object(builtins, "builtins"), str_of(name));
}

// ---- values entering the trace ------------------------------------------------------------------

VarPtr Tracer::wrap_tensor(PyObject* tensor, SourcePtr source) {
  auto it = tensor_vars_.find(tensor);
  if (it != tensor_vars_.end()) {
    // The same tensor reached twice (tied weights, f(x, x)): one graph input, and a guard that the
    // two paths still lead to one object.
    if (source) guards_->add_same_object(tensor_first_source_[tensor], source);
    return it->second;
  }
  KILN_CHECK(source) << "internal: a real tensor reached the tracer without a source";
  guards_->add_tensor(source, tensor);
  PyObject* fake = check(PyObject_CallMethod(recorder_, "add_input", "O", tensor), "recording a graph input");
  VarPtr v = make_tensor(fake, Py_TYPE(tensor), source);
  Py_DECREF(fake);
  PyList_Append(example_inputs_, tensor);
  input_sources_.push_back(source);
  tensor_vars_[tensor] = v;
  tensor_first_source_[tensor] = source;
  // The Var holds the fake; keep the real tensor alive as long as the map refers to it.
  return v;
}

VarPtr Tracer::wrap(PyObject* value, SourcePtr source) {
  if (is_tensor(value)) return wrap_tensor(value, std::move(source));
  if (is_simple_constant(value)) {
    if (source) guards_->add_constant(source, value);
    return make_const(value, source);
  }
  if (is_module(value)) {
    if (source) guards_->add_id(source, value);
    return make_module(value, source);
  }
  if (PyTuple_CheckExact(value) || PyList_CheckExact(value)) {
    bool tuple = PyTuple_CheckExact(value);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
    if (source && !tuple) {
      // As for dicts below: one Var per list, so a change made through one path (an append the compiled frame
      // replays, claim_container) is seen through every other; the paths must keep leading to one list.
      auto seen = containers_from_frame_.find(value);
      if (seen != containers_from_frame_.end()) {
        guards_->add_same_object(seen->second->source, source);
        return seen->second;
      }
    }
    if (source) {
      guards_->add_type(source, Py_TYPE(value));
      guards_->add_length(source, n);
    }
    std::vector<VarPtr> items;
    for (Py_ssize_t i = 0; i < n; ++i)
      items.push_back(wrap(PySequence_Fast_GET_ITEM(value, i), source ? Source::index(source, i) : nullptr));
    // A list from outside keeps its source: the trace mutates it only through claim_container, which has the
    // compiled frame replay its final items into the real list after the graph.
    VarPtr seq = make_sequence(tuple ? VarKind::kTuple : VarKind::kList, std::move(items), source);
    if (source && !tuple) {
      seq->built_from = Py_NewRef(value);
      containers_from_frame_.emplace(value, seq);
    }
    return seq;
  }
  if (source && PyTuple_Check(value)) {
    // A namedtuple or structseq argument: its items, so indexing and field reads stay symbolic.
    if (PyObject* fields = tuple_fields(Py_TYPE(value))) {
      Py_DECREF(fields);
      Py_ssize_t n = PyTuple_GET_SIZE(value);
      guards_->add_type(source, Py_TYPE(value));
      guards_->add_length(source, n);
      std::vector<VarPtr> items;
      for (Py_ssize_t i = 0; i < n; ++i) items.push_back(wrap(PyTuple_GET_ITEM(value, i), Source::index(source, i)));
      VarPtr v = make_typed_tuple(Py_TYPE(value), std::move(items));
      v->source = source;
      return v;
    }
  }
  if (PyDict_CheckExact(value)) {
    std::vector<PyObject*> keys;
    std::vector<VarPtr> items;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    bool plain_keys = true;  // Source::is_plain_key: each item gets a source of its own (Source::dict_item)
    while (PyDict_Next(value, &pos, &k, &v)) plain_keys = plain_keys && Source::is_plain_key(k);
    if (plain_keys) {
      if (source) {
        // The same dict reached again (another path, or the same one read twice): the same Var, so what the
        // trace changes in it shows through both; the two paths must keep leading to one dict.
        auto seen = containers_from_frame_.find(value);
        if (seen != containers_from_frame_.end()) {
          guards_->add_same_object(seen->second->source, source);
          return seen->second;
        }
        guards_->add_type(source, Py_TYPE(value));
        PyObject* key_tuple = PySequence_Tuple(value);
        guards_->add_dict_keys(source, key_tuple);
        Py_DECREF(key_tuple);
      }
      pos = 0;
      while (PyDict_Next(value, &pos, &k, &v)) {
        Py_INCREF(k);
        keys.push_back(k);
        items.push_back(wrap(v, source ? Source::dict_item(source, k) : nullptr));
      }
      VarPtr dict = make_dict(std::move(keys), std::move(items), source);
      if (source) {
        dict->built_from = Py_NewRef(value);
        containers_from_frame_.emplace(value, dict);
      }
      return dict;
    }
  }
  // Functions, classes, Python modules and other callables are pinned by identity. Plain objects
  // (configs, context managers, user instances) are pinned by type: what the trace reads of them goes
  // through attribute sources with guards of their own, and a new instance per call (a fresh
  // `torch.no_grad()`) then does not recompile.
  if (!source) return make_const(value);
  // A bound method is a new object on every attribute read: guard its function and its self instead.
  if (PyMethod_Check(value) && PyFunction_Check(PyMethod_GET_FUNCTION(value))) {
    guards_->add_type(source, Py_TYPE(value));
    guards_->add_id(Source::attr(source, "__func__"), PyMethod_GET_FUNCTION(value));
    return make_method(PyMethod_GET_FUNCTION(value), wrap(PyMethod_GET_SELF(value), Source::attr(source, "__self__")));
  }
  PyTypeObject* t = Py_TYPE(value);
  PyObject* c_self = PyCFunction_Check(value) ? PyCFunction_GET_SELF(value) : nullptr;
  bool bound_builtin = c_self && !PyModule_Check(c_self);  // e.g. obj.__exit__ of a C type: new per read
  bool stable = (PyFunction_Check(value) || PyCFunction_Check(value) || PyType_Check(value) || PyModule_Check(value) ||
                 t == &PyMethodDescr_Type || t == &PyWrapperDescr_Type || t == &PyClassMethodDescr_Type ||
                 t == &PyEllipsis_Type || t == &PySlice_Type) &&
                !bound_builtin;
  if (!stable && !PyCFunction_Check(value)) {  // torch.ops' operator objects (kiln._tracing.TORCH_OP_TYPES)
    int op = PyObject_IsInstance(value, helper("TORCH_OP_TYPES"));
    if (op < 0) PyErr_Clear();
    stable = op == 1;
  }
  VarPtr v = make_const(value, source);
  PyObject* closure = PyFunction_Check(value) ? PyFunction_GET_CLOSURE(value) : nullptr;
  if (closure && PyTuple_GET_SIZE(closure) > 0 && !PyFunction_GET_KW_DEFAULTS(value) && from_resume_frame(source)) {
    // A closure handed to a resume function (a helper defined in forward before a break) is made anew on
    // every call of the function: guarded by its code, its defaults and its cells' contents (read through
    // the source, so a call of it, or its use by a recorded torch call, sees this call's cells).
    guards_->add_type(source, Py_TYPE(value));
    guards_->add_id(Source::attr(source, "__code__"), PyFunction_GET_CODE(value));
    PyObject* defaults = PyFunction_GET_DEFAULTS(value);
    guards_->add_id(Source::attr(source, "__defaults__"), defaults ? defaults : Py_None);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(closure); ++j) {
      PyObject* contents = PyCell_GET(PyTuple_GET_ITEM(closure, j));
      SourcePtr cell = Source::attr(Source::index(Source::attr(source, "__closure__"), j), "cell_contents");
      if (contents == value)  // a function naming itself: reached through `source`, not one step deeper per call
        guards_->add_same_object(cell, source);
      else if (contents)
        wrap(contents, cell);
    }
  } else if (stable) {
    guards_->add_id(source, value);
  } else {
    guards_->add_type(source, Py_TYPE(value));
    guard_grad_mode_context(value, source);
    v->by_type = true;
  }
  return v;
}

bool Tracer::from_resume_frame(const SourcePtr& source) const {
  const char* qualname = PyUnicode_AsUTF8(root_.code->co_qualname);
  if (!qualname) {
    PyErr_Clear();
    return false;
  }
  if (!strstr(qualname, KILN_RESUME_QUALNAME_MARKER)) return false;  // not a resume function
  const Source* s = source.get();
  while (s->base()) s = s->base().get();
  return s->kind() == SourceKind::kLocal;
}

VarPtr Tracer::wrap_result(PyObject* value) {
  if (standins_.count(value))
    KILN_UNSUPPORTED() << "a " << Py_TYPE(value)->tp_name << " made in the trace was handed out by code run at trace time "
                       << "(not mapped back to the traced object)";
  int fake = 0;
  if (is_tensor(value)) {
    PyObject* r = check(PyObject_CallMethod(recorder_, "is_fake", "O", value), "recorder.is_fake");
    fake = PyObject_IsTrue(r);
    Py_DECREF(r);
    static PyObject* tensor_type = nullptr;
    if (!tensor_type) {
      PyObject* torch = PyImport_ImportModule("torch");
      tensor_type = PyObject_GetAttrString(torch, "Tensor");
      Py_DECREF(torch);
    }
    if (fake) return make_tensor(value, (PyTypeObject*)tensor_type);
    KILN_UNSUPPORTED() << "a function returned a real tensor while tracing (an untracked tensor constant)";
  }
  if (PyTuple_CheckExact(value) || PyList_CheckExact(value)) {
    std::vector<VarPtr> items;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
    for (Py_ssize_t i = 0; i < n; ++i) items.push_back(wrap_result(PySequence_Fast_GET_ITEM(value, i)));
    return make_sequence(PyTuple_CheckExact(value) ? VarKind::kTuple : VarKind::kList, std::move(items));
  }
  // torch.return_types (torch.max(x, 1), x.sort()) and namedtuples: typed tuples of their items, never a
  // constant holding fakes.
  if (PyTuple_Check(value)) {
    if (PyObject* fields = tuple_fields(Py_TYPE(value))) {
      Py_DECREF(fields);
      std::vector<VarPtr> items;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); ++i) items.push_back(wrap_result(PyTuple_GET_ITEM(value, i)));
      return make_typed_tuple(Py_TYPE(value), std::move(items));
    }
  }
  return make_const(value);
}

// ---- attributes ------------------------------------------------------------------------------------

VarPtr Tracer::module_attr(const VarPtr& module, PyObject* name) {
  PyObject* m = module->value;
  PyObject** dictptr = _PyObject_GetDictPtr(m);
  PyObject* dict = dictptr ? *dictptr : nullptr;
  const SourcePtr& src = module->source;
  if (dict) {
    if (PyObject* v = PyDict_GetItemWithError(dict, name))
      return wrap(v, src ? Source::instance_dict(src, str_of(name)) : nullptr);
    for (const char* slot : {"_parameters", "_buffers", "_modules"}) {
      PyObject* d = PyDict_GetItemString(dict, slot);
      if (!d || !PyDict_Check(d)) continue;
      if (PyObject* v = PyDict_GetItemWithError(d, name))
        return wrap(v, src ? Source::module_slot(src, slot, str_of(name)) : nullptr);
    }
  }
  // Class attributes: methods bind to the module Var so their bodies are traced with `self` symbolic.
  PyObject* cls_attr = _PyType_Lookup(Py_TYPE(m), name);
  if (cls_attr && PyFunction_Check(cls_attr)) return make_method(cls_attr, module);
  if (cls_attr && Py_TYPE(cls_attr) == &PyProperty_Type) {
    PyObject* getter = PyObject_GetAttrString(cls_attr, "fget");
    VarPtr fget = make_const_steal(check(getter, "property.fget"));
    return call(fget, {module}, {});
  }
  PyObject* v = check(PyObject_GetAttr(m, name), "getattr on module");
  VarPtr out = wrap(v, src ? Source::attr(src, str_of(name)) : nullptr);
  Py_DECREF(v);
  return out;
}

VarPtr Tracer::get_attr(const VarPtr& obj, PyObject* name) {
  if (!stores_.empty() && obj->value && (obj->is(VarKind::kModule) || obj->is(VarKind::kConst)))
    if (VarPtr stored = stored_value(obj->value, name)) return stored;
  std::string attr = str_of(name);
  switch (obj->kind) {
    case VarKind::kModule: return module_attr(obj, name);
    case VarKind::kTensor: {
      // The fake lives on the meta device; the traced program must see the real one.
      if (attr == "device") {
        PyObject* d = check(PyObject_CallMethod(recorder_, "device_of", "O", obj->value), "recorder.device_of");
        return make_const_steal(d);
      }
      if (attr == "is_cuda" || attr == "is_cpu") {
        PyObject* d = check(PyObject_CallMethod(recorder_, "device_of", "O", obj->value), "recorder.device_of");
        PyObject* type = PyObject_GetAttrString(d, "type");
        Py_DECREF(d);
        check(type, "device.type");
        bool on = str_of(type) == (attr == "is_cuda" ? "cuda" : "cpu");
        Py_DECREF(type);
        return make_const(on ? Py_True : Py_False);
      }
      if (attr == "grad" || attr == "data" || attr == "_version" || attr == "grad_fn" || attr == "is_meta" ||
          attr == "untyped_storage" || attr == "data_ptr")
        KILN_UNSUPPORTED() << "tensor." << attr << " is not traced yet";
      // Methods stay bound to the tensor's Var (not to its fake), so a graph break can rebind them to
      // the real tensor; calls go to the recorder with the Var as self.
      PyObject* descr = _PyType_Lookup(obj->real_type, name);
      if (descr && (Py_TYPE(descr) == &PyMethodDescr_Type || PyFunction_Check(descr))) return make_method(descr, obj);
      PyObject* getattr = PyDict_GetItemString(PyEval_GetBuiltins(), "getattr");
      std::vector<VarPtr> args = {obj, make_const(name)};
      return call_recorded(getattr, args, {});
    }
    case VarKind::kConst: {
      // obj.method of a plain object: bound to the object's Var (a fresh bound-method object on every
      // access would fail an identity guard on each call).
      if (!PyModule_Check(obj->value) && !PyType_Check(obj->value)) {
        PyObject* descr = _PyType_Lookup(Py_TYPE(obj->value), name);
        PyObject** dictptr = descr && PyFunction_Check(descr) ? _PyObject_GetDictPtr(obj->value) : nullptr;
        bool shadowed = dictptr && *dictptr && PyDict_GetItemWithError(*dictptr, name);
        if (PyErr_Occurred()) PyErr_Clear();
        if (descr && PyFunction_Check(descr) && !shadowed) return make_method(descr, obj);
        // A property of a plain object (a dataclass argument's): its getter is traced, so the tensor work
        // in it lands in the graph instead of running, uncaptured, in every guard check's source read.
        descr = descr ? descr : _PyType_Lookup(Py_TYPE(obj->value), name);
        if (descr && Py_TYPE(descr) == &PyProperty_Type) {
          PyObject* getter = check(PyObject_GetAttrString(descr, "fget"), "property.fget");
          if (PyFunction_Check(getter)) return call(make_const_steal(getter), {obj}, {});
          Py_DECREF(getter);
        }
      }
      PyObject* v = PyObject_GetAttr(obj->value, name);
      if (!v && obj->source && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        // Eager raises AttributeError here, which the traced code may catch (`try: x = obj.name` / `except
        // AttributeError:`): the guard asks again that the object still lacks it.
        guards_->add_has_no_attr(obj->source, attr);
        raise_pending("reading ." + attr);
      }
      check(v, "getattr " + attr);
      VarPtr out;
      // Attributes of torch's own modules (torch.float32, torch.nn.functional.relu) are taken as fixed.
      bool torch_module = false;
      if (PyModule_Check(obj->value)) {
        const char* mn = PyModule_GetName(obj->value);
        if (!mn) PyErr_Clear();
        torch_module = mn && (std::string(mn) == "torch" || std::string(mn).rfind("torch.", 0) == 0 ||
                              std::string(mn) == "math" || std::string(mn) == "operator");
      }
      if (torch_module || !obj->source)
        out = is_tensor(v) ? wrap(v, obj->source ? Source::attr(obj->source, attr) : nullptr) : make_const(v);
      else
        out = wrap(v, Source::attr(obj->source, attr));
      Py_DECREF(v);
      return out;
    }
    case VarKind::kObject: return record_attr(obj, name);
    case VarKind::kUserObject: return user_object_attr(obj, name);
    case VarKind::kDict:
    case VarKind::kList:
    case VarKind::kTuple: {
      if (obj->is(VarKind::kTuple) && obj->real_type) return record_attr(obj, name);
      if (obj->is(VarKind::kList) && obj->real_type && !_PyType_Lookup(obj->real_type, name))
        KILN_UNSUPPORTED() << "attribute ." << attr << " of a slice of a " << obj->real_type->tp_name;
      // Methods of symbolic containers (d.get, d.items, l.append) are applied structurally on call.
      PyTypeObject* type = obj->is(VarKind::kDict) ? &PyDict_Type : obj->is(VarKind::kList) ? &PyList_Type : &PyTuple_Type;
      if (PyObject* descr = _PyType_Lookup(type, name)) return make_method(descr, obj);
      break;
    }
    default: break;
  }
  KILN_UNSUPPORTED() << "attribute ." << attr << " of a " << obj->describe();
}

// ---- operators ---------------------------------------------------------------------------------------

VarPtr Tracer::binary(PyObject* op, const VarPtr& a, const VarPtr& b) {
  if (a->is(VarKind::kTensor) || b->is(VarKind::kTensor)) return call_recorded(op, {a, b}, {});
  if (is_constant(a) && is_constant(b)) {
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
  Py_XDECREF(add);
  if ((a->is(VarKind::kList) && a->real_type) || (b->is(VarKind::kList) && b->real_type))
    KILN_UNSUPPORTED() << "operator on a slice of a ModuleList";
  if ((op == add_fn || op == iadd_fn) && a->kind == b->kind &&
      (a->is(VarKind::kTuple) || a->is(VarKind::kList))) {
    std::vector<VarPtr> items = a->items;
    items.insert(items.end(), b->items.begin(), b->items.end());
    if (op == iadd_fn && a->is(VarKind::kList) && !a->real_type && claim_container(a)) {  // in place, as list.__iadd__
      a->items = items;
      return a;
    }
    return make_sequence(a->kind, std::move(items));
  }
  KILN_UNSUPPORTED() << "operator on " << a->describe() << " and " << b->describe();
}

VarPtr Tracer::subscript(const VarPtr& obj, const VarPtr& index) {
  if (obj->is(VarKind::kUserObject)) {
    VarPtr getitem = python_special_method(obj, "__getitem__");
    if (!getitem) KILN_UNSUPPORTED() << "subscript of a " << obj->describe() << " (its class has no Python __getitem__)";
    return call(getitem, {index}, {});
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
      if (PySlice_GetIndicesEx(i, obj->items.size(), &start, &stop, &step, &len) < 0) throw_python_error("slice");
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
    // A dict made in the trace holds exactly its keys here, as in eager.
    if (obj->source || obj->built_from) KILN_UNSUPPORTED() << "dict key not found";
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
    case VarKind::kConst: {
      // An object pinned by type only (a deque, a user object): its truth is its state. A __bool__ or __len__
      // written in Python is traced (its reads carry their guards), a C length is guarded, others run in Python.
      if (v->by_type && v->source) {
        VarPtr test = python_special_method(v, "__bool__");
        if (!test) test = python_special_method(v, "__len__");
        if (test) return truthy(call(test, {}, {}));
      }
      int r = PyObject_IsTrue(v->value);
      if (r < 0) throw_python_error("truth value");
      if (v->by_type && v->source) {
        PyTypeObject* t = Py_TYPE(v->value);
        const auto [has_bool, has_len] = bool_and_len_slots(t);
        if (has_bool || (has_len && (t->tp_flags & Py_TPFLAGS_HEAPTYPE)))
          KILN_UNSUPPORTED() << "truth value of a " << t->tp_name << " (its __bool__ or __len__ is not traced)";
        if (has_len) {
          Py_ssize_t n = PyObject_Length(v->value);
          if (n < 0) throw_python_error("len");
          guards_->add_length(v->source, n);
        }
      }
      return r;
    }
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kDict: return !v->items.empty();
    case VarKind::kModule: {
      // `if self.extra:` of a ModuleList is its length: guarded as iteration guards it. A module without __bool__
      // or __len__ is always true (its class is guarded); any other's are not traced.
      const auto [has_bool, has_len] = bool_and_len_slots(Py_TYPE(v->value));
      if (has_bool || has_len) guard_container_items(v);
      [[fallthrough]];
    }
    case VarKind::kObject: {
      int r = PyObject_IsTrue(v->value);
      if (r < 0) throw_python_error("truth value of a " + v->describe());
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
    case VarKind::kList: return v->items;
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

// ---- the driver --------------------------------------------------------------------------------------

VarPtr Tracer::trace_root() {
  // Grad-mode blocks switch the real mode while tracing (grad_mode.cpp); the frame then runs from the
  // mode it was called in, however the trace ended.
  TraceModeRestore restore_grad_mode(*this);
  PyCodeObject* code = root_.code;
  std::vector<VarPtr> locals(root_.nlocalsplus);
  PyObject* names = PyCode_GetVarnames(code);
  int nargs = argument_slots(code);
  for (int i = 0; i < nargs && i < root_.nlocalsplus; ++i) {
    PyObject* value = root_.localsplus[i];
    if (!value) continue;
    std::string name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(names, i));
    locals[i] = wrap(value, Source::local(i, name));
    // A module's forward (or its resume functions, which keep the name): entries per instance.
    if (name == "self" && locals[i]->is(VarKind::kModule)) guards_->set_instance(locals[i]->source, value);
  }
  Py_XDECREF(names);
  std::vector<VarPtr> freevars;
  PyObject* freenames = PyCode_GetFreevars(code);
  Py_ssize_t nfree = freenames ? PyTuple_GET_SIZE(freenames) : 0;
  for (Py_ssize_t j = 0; j < nfree; ++j) {
    PyObject* cell = root_.closure ? PyTuple_GET_ITEM(root_.closure, j) : nullptr;
    PyObject* value = cell ? PyCell_GET(cell) : nullptr;
    std::string name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(freenames, j));
    freevars.push_back(value ? wrap(value, Source::free((int)j, name)) : nullptr);
  }
  Py_XDECREF(freenames);

  InstructionTranslator root(*this, code, root_.globals, root_.builtins, std::move(locals), std::move(freevars),
                             root_.closure);
  return root.run();
}

}  // namespace kiln::trace
