// Tracer: values entering the trace (guards), attribute access, results, and the trace driver; operators,
// truth and iteration are in tracer_operators.cpp.
#include "trace/tracer.h"

#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "frame/cpython_shim.h"  // KILN_RESUME_QUALNAME_MARKER
#include "trace/code_layout.h"
#include "trace/interpreter.h"
#include "trace/traced_raise.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

namespace {

using detail::check;
using detail::is_module;
using detail::is_module_list;
using detail::is_tensor;
using detail::str_of;

// Values compared by value in guards.
bool is_simple_constant(PyObject* o) {
  if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) ||
      PyBytes_CheckExact(o))
    return true;
  const char* tn = Py_TYPE(o)->tp_name;
  // numpy's scalars (np.float32(0.5), an int64 from arr.sum()) are immutable values: guarded by type and value.
  if (strncmp(tn, "numpy.", 6) == 0) {
    static PyObject* generic = [] {
      PyObject* numpy = PyImport_ImportModule("numpy");  // loaded already: one of its objects is here
      PyObject* g = numpy ? PyObject_GetAttrString(numpy, "generic") : nullptr;
      Py_XDECREF(numpy);
      if (!g) PyErr_Clear();
      return g;
    }();
    if (generic && PyObject_IsInstance(o, generic) == 1) return true;
    PyErr_Clear();
  }
  return std::string(tn) == "torch.dtype" || std::string(tn) == "torch.device" || std::string(tn) == "torch.Size" ||
         std::string(tn) == "torch.layout" || std::string(tn) == "torch.memory_format";
}

}  // namespace

TraceResult::~TraceResult() {
  Py_XDECREF(graph);
  Py_XDECREF(example_inputs);
}

Tracer::Tracer(const FrameInput& frame, DynamicPolicy dynamic)
    : root_(frame), guards_(std::make_unique<guards::GuardTree>()) {
  if (dynamic.mode != compile::Dynamic::kStatic) symbolic_ = std::make_unique<SymbolicInts>(std::move(dynamic));
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
  if (symbolic_) symbolic_->add_input(tensor, fake, source, (int)input_sources_.size());
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
  if (source && (PySet_CheckExact(value) || PyFrozenSet_CheckExact(value)))
    if (VarPtr s = frame_set(value, source)) return s;
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
  if (!stable && !PyCFunction_Check(value)) {  // torch.ops' operator objects (kiln._tracing.TORCH_OP_TYPES), enum
    // members (singletons: `mode is Mode.TRAIN` needs their identity) and functools' cached functions
    int op = PyObject_IsInstance(value, helper("TORCH_OP_TYPES"));
    if (op == 0) op = PyObject_IsInstance(value, helper("ENUM_TYPES"));
    if (op == 0) op = PyObject_IsInstance(value, helper("CACHED_FUNCTION_TYPES"));
    if (op == 0) op = PyObject_IsInstance(value, helper("TYPING_TYPES"));
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

VarPtr Tracer::tensor_instance_attr(const VarPtr& tensor, PyObject* name, bool* found) {
  *found = false;
  if (!tensor->source) return nullptr;  // made in the trace: no attribute set on it (a store would have broken)
  PyObject* real = nullptr;
  for (const auto& [object, var] : tensor_vars_)
    if (var == tensor) real = object;
  if (!real) return nullptr;
  PyObject* v = PyObject_GetAttr(real, name);
  if (!v) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) rethrow_python("reading ." + str_of(name));
    PyErr_Clear();
    guards_->add_has_no_attr(tensor->source, str_of(name));
    return nullptr;
  }
  *found = true;
  VarPtr out = wrap(v, Source::attr(tensor->source, str_of(name)));
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
      if (!_PyType_Lookup(obj->real_type, name)) {
        // Not an attribute of its class: one the program set on this tensor (`p.sharded = True`), which the fake
        // does not have. Read from the real tensor, guarded; AttributeError as in eager when it has none.
        bool found = false;
        VarPtr v = tensor_instance_attr(obj, name, &found);
        if (found) return v;
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'", obj->real_type->tp_name, name);
        raise_pending("reading ." + attr);
      }
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
    case VarKind::kSet:  // applied to its real set on call (sets.cpp)
      if (PyObject* descr = _PyType_Lookup(obj->real_type, name)) return make_method(descr, obj);
      break;
    case VarKind::kDict:
    case VarKind::kList:
    case VarKind::kTuple: {
      if (obj->is(VarKind::kTuple) && obj->real_type) return record_attr(obj, name);
      if (obj->is(VarKind::kList) && obj->real_type && !_PyType_Lookup(obj->real_type, name))
        KILN_UNSUPPORTED() << "attribute ." << attr << " of a slice of a " << obj->real_type->tp_name;
      // Methods of symbolic containers (d.get, d.items, l.append) are applied structurally on call.
      // An OrderedDict made in the trace (real_type) finds its own methods (move_to_end), applied like dict's.
      PyTypeObject* type = obj->is(VarKind::kDict) ? (obj->real_type ? obj->real_type : &PyDict_Type)
                           : obj->is(VarKind::kList) ? &PyList_Type : &PyTuple_Type;
      if (PyObject* descr = _PyType_Lookup(type, name)) return make_method(descr, obj);
      break;
    }
    default: break;
  }
  KILN_UNSUPPORTED() << "attribute ." << attr << " of a " << obj->describe();
}

// ---- the driver --------------------------------------------------------------------------------------

VarPtr Tracer::trace_root() {
  // Grad-mode blocks switch the real mode while tracing (grad_mode.cpp); the frame then runs from the
  // mode it was called in, however the trace ended.
  TraceModeRestore restore_grad_mode(*this);
  const SymbolicIntsScope symbolic_ints(symbolic_.get());
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
