#include "trace/variables.h"

#include "trace/symbolic_ints.h"
#include "trace/interpreter.h"

#include "common/error.h"
#include "runtime/frame_program.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

Var::~Var() {
  Py_XDECREF(value);
  Py_XDECREF(built_from);
  for (PyObject* k : keys) Py_DECREF(k);
}

namespace {
std::string short_repr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  if (!r) {
    PyErr_Clear();
    return Py_TYPE(o)->tp_name;
  }
  std::string s = PyUnicode_AsUTF8(r);
  Py_DECREF(r);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}
}  // namespace

std::string Var::describe() const {
  switch (kind) {
    case VarKind::kNull: return "NULL";
    case VarKind::kConst: return std::string(Py_TYPE(value)->tp_name) + " " + short_repr(value);
    case VarKind::kSymInt: return "int " + short_repr(value) + " (the size expression " + sym.to_string() + ")";
    case VarKind::kTensor: return "Tensor";
    case VarKind::kModule: return std::string("module ") + Py_TYPE(value)->tp_name;
    case VarKind::kTuple:
      return (real_type ? std::string(real_type->tp_name) : std::string("tuple")) + "[" + std::to_string(items.size()) + "]";
    case VarKind::kList: return "list[" + std::to_string(items.size()) + "]";
    case VarKind::kDict: return "dict[" + std::to_string(items.size()) + "]";
    case VarKind::kMethod: return "method " + short_repr(value);
    case VarKind::kIterator: return "iterator";
    case VarKind::kSlice: return "slice";
    case VarKind::kObject: return std::string(real_type->tp_name) + " instance";
    case VarKind::kSuper: return "super(" + items[0]->describe() + ")";
    case VarKind::kCell: return "cell";
    case VarKind::kFunction: return "function " + short_repr(value) + " (made in the trace)";
    case VarKind::kPartial: return "functools.partial of " + items[0]->describe();
    case VarKind::kToken: return "ContextVar token";
    case VarKind::kGenerator: return "generator made in the trace";
    case VarKind::kUserObject: return std::string(real_type->tp_name) + " object (made in the trace)";
    case VarKind::kSet: return std::string(real_type->tp_name) + "[" + std::to_string(items.size()) + "]";
  }
  return "?";
}

VarPtr make_null() {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kNull;
  return v;
}

VarPtr make_const(PyObject* value, SourcePtr source) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kConst;
  Py_INCREF(value);
  v->value = value;
  v->source = std::move(source);
  return v;
}

VarPtr make_const_steal(PyObject* value) {
  if (!value) return nullptr;
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kConst;
  v->value = value;
  return v;
}

VarPtr make_tensor(PyObject* fake, PyTypeObject* real_type, SourcePtr source) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kTensor;
  Py_INCREF(fake);
  v->value = fake;
  v->real_type = real_type;
  v->source = std::move(source);
  return v;
}

VarPtr make_module(PyObject* module, SourcePtr source) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kModule;
  Py_INCREF(module);
  v->value = module;
  v->source = std::move(source);
  return v;
}

VarPtr make_sequence(VarKind kind, std::vector<VarPtr> items, SourcePtr source) {
  auto v = std::make_shared<Var>();
  v->kind = kind;
  v->items = std::move(items);
  v->source = std::move(source);
  return v;
}

VarPtr make_dict(std::vector<PyObject*> keys, std::vector<VarPtr> items, SourcePtr source) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kDict;
  v->keys = std::move(keys);
  v->items = std::move(items);
  v->source = std::move(source);
  return v;
}

VarPtr make_method(PyObject* function, VarPtr self) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kMethod;
  Py_INCREF(function);
  v->value = function;
  v->items.push_back(std::move(self));
  return v;
}

VarPtr make_typed_tuple(PyTypeObject* type, std::vector<VarPtr> items) {
  VarPtr v = make_sequence(VarKind::kTuple, std::move(items));
  v->real_type = type;
  return v;
}

VarPtr make_object(PyObject* instance, std::vector<VarPtr> args, std::vector<PyObject*> kwnames, PyObject* built_from) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kObject;
  Py_INCREF(instance);
  v->value = instance;
  v->real_type = Py_TYPE(instance);
  v->items = std::move(args);
  v->keys = std::move(kwnames);
  Py_INCREF(built_from);
  v->built_from = built_from;
  return v;
}

VarPtr make_user_object(PyTypeObject* cls, SourcePtr class_source) {
  auto v = std::make_shared<Var>();
  v->kind = VarKind::kUserObject;
  v->real_type = cls;
  v->built_from = Py_NewRef((PyObject*)cls);
  v->class_source = std::move(class_source);
  return v;
}

VarPtr make_super_factory(VarPtr cls, VarPtr obj) {
  VarPtr v = make_method((PyObject*)&PySuper_Type, std::move(cls));
  v->items.push_back(std::move(obj));
  return v;
}

bool is_super_factory(const VarPtr& v) {
  return v->is(VarKind::kMethod) && v->value == (PyObject*)&PySuper_Type && v->items.size() == 2;
}

VarPtr make_super(VarPtr cls, VarPtr obj) {
  VarPtr v = make_sequence(VarKind::kSuper, {std::move(cls), std::move(obj)});
  return v;
}

VarPtr make_cell(VarPtr contents) { return make_sequence(VarKind::kCell, {std::move(contents)}); }

VarPtr make_set_var(PyTypeObject* type, std::vector<VarPtr> items, SourcePtr source) {
  VarPtr v = make_sequence(VarKind::kSet, std::move(items), std::move(source));
  v->real_type = type;
  return v;
}

bool holds_symbolic_int(const VarPtr& v) {
  if (v->is(VarKind::kSymInt)) return true;
  if (v->is(VarKind::kTuple) || v->is(VarKind::kList) || v->is(VarKind::kDict) || v->is(VarKind::kSlice))
    for (const VarPtr& item : v->items)
      if (holds_symbolic_int(item)) return true;
  return false;
}

bool is_constant(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kConst:
    case VarKind::kSymInt: return true;  // (its Python value pins it: to_python)
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kDict:
    case VarKind::kSlice:
    case VarKind::kSet:
      for (const VarPtr& item : v->items)
        if (!is_constant(item)) return false;
      return true;
    default: return false;
  }
}

PyObject* to_python(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kSymInt:
      if (SymbolicInts* s = active_symbolic_ints(); s && !pins_suppressed()) {
        const std::string where = current_trace_location();
        s->pin(v, "used as a Python value" + (where.empty() ? std::string() : " at " + where));
      }
      Py_INCREF(v->value);
      return v->value;
    case VarKind::kConst:
    case VarKind::kTensor:
    case VarKind::kObject:
    case VarKind::kModule: Py_INCREF(v->value); return v->value;
    case VarKind::kTuple:
    case VarKind::kList: {
      bool tuple = v->kind == VarKind::kTuple;
      PyObject* out = tuple ? PyTuple_New(v->items.size()) : PyList_New(v->items.size());
      if (!out) return nullptr;
      for (size_t i = 0; i < v->items.size(); ++i) {
        PyObject* item = to_python(v->items[i]);
        if (!item) {
          Py_DECREF(out);
          return nullptr;
        }
        if (tuple)
          PyTuple_SET_ITEM(out, i, item);
        else
          PyList_SET_ITEM(out, i, item);
      }
      if (tuple && v->real_type) Py_SETREF(out, runtime::make_structured_tuple(v->real_type, out));
      if (!tuple && v->real_type && out) {
        if (is_dict_view(v)) {  // a view of a dict with those keys (items)
          PyObject* dict = v->real_type == &PyDictKeys_Type ? PyObject_CallMethod((PyObject*)&PyDict_Type, "fromkeys", "O", out)
                                                            : PyObject_CallOneArg((PyObject*)&PyDict_Type, out);
          Py_SETREF(out, dict ? PyObject_CallMethod(dict, v->real_type == &PyDictKeys_Type ? "keys" : "items", nullptr) : nullptr);
          Py_XDECREF(dict);
        } else {
          Py_SETREF(out, PyObject_CallOneArg((PyObject*)v->real_type, out));  // ModuleList(list)
        }
      }
      return out;
    }
    case VarKind::kDict: {
      PyObject* out = PyDict_New();
      for (size_t i = 0; i < v->items.size(); ++i) {
        PyObject* item = to_python(v->items[i]);
        if (!item || PyDict_SetItem(out, v->keys[i], item) < 0) {
          Py_XDECREF(item);
          Py_DECREF(out);
          return nullptr;
        }
        Py_DECREF(item);
      }
      if (v->real_type == detail::default_dict_type())  // defaultdict(factory, dict)
        Py_SETREF(out, PyObject_CallFunctionObjArgs((PyObject*)v->real_type, v->value ? v->value : Py_None, out, nullptr));
      else if (v->real_type)
        Py_SETREF(out, PyObject_CallOneArg((PyObject*)v->real_type, out));  // OrderedDict(dict)
      return out;
    }
    case VarKind::kSet:
      // Its real set (trace/sets.cpp): the callers that fold pure builtins read it, never change it, and see the
      // iteration order eager's set has.
      if (v->value) {
        Py_INCREF(v->value);
        return v->value;
      }
      break;
    case VarKind::kSlice: {
      PyObject* a = to_python(v->items[0]);
      PyObject* b = to_python(v->items[1]);
      PyObject* c = to_python(v->items[2]);
      PyObject* s = (a && b && c) ? PySlice_New(a, b, c) : nullptr;
      Py_XDECREF(a);
      Py_XDECREF(b);
      Py_XDECREF(c);
      return s;
    }
    case VarKind::kFunction:
      // Without a closure the function is its value; with one, its cells hold trace-time Vars.
      if (v->items.empty()) {
        Py_INCREF(v->value);
        return v->value;
      }
      break;
    case VarKind::kMethod: {
      if (is_super_factory(v)) break;
      PyObject* self = to_python(v->items[0]);
      if (!self) return nullptr;
      PyObject* m = PyMethod_New(v->value, self);
      Py_DECREF(self);
      return m;
    }
    default: break;
  }
  KILN_UNSUPPORTED() << "a " << v->describe() << " cannot be passed to a function called on fake tensors";
}

}  // namespace kiln::trace
