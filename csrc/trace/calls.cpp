// Calls while tracing: which calls run on fakes through the recorder (torch's API, built-in torch.nn
// modules), which are inlined (user functions, user modules' forward), which builtins are folded.
#include <algorithm>

#include "common/error.h"
#include "common/log.h"
#include "trace/call_helpers.h"
#include "trace/interpreter.h"
#include "trace/traced_raise.h"
#include "trace/tracer_helpers.h"
#include <optional>

#include "trace/tracer.h"

namespace kiln::trace {

using namespace calls;

namespace {

constexpr int kMaxInlineDepth = 64;

// Whether a tensor among `v` (containers searched) requires grad: its fake says so, as eager's tensor would.
bool requires_grad(const VarPtr& v) {
  if (v->is(VarKind::kTensor)) {
    PyObject* flag = PyObject_GetAttrString(v->value, "requires_grad");
    if (!flag) rethrow_python("reading requires_grad");
    const bool on = flag == Py_True;
    Py_DECREF(flag);
    return on;
  }
  if (v->is(VarKind::kTuple) || v->is(VarKind::kList) || v->is(VarKind::kDict))
    return std::any_of(v->items.begin(), v->items.end(), requires_grad);
  return false;
}

// A Python number, or a tuple or list of them (torch.Size, `_pair(n)`): what a call computed at trace time.
bool is_number_or_numbers(PyObject* result) {
  if (PyLong_Check(result) || PyFloat_Check(result)) return true;
  if (!PyTuple_Check(result) && !PyList_Check(result)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(result);
  if (n == 0) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(result, i);
    if (!PyLong_Check(item) && !PyFloat_Check(item)) return false;
  }
  return true;
}

bool any_requires_grad(const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  return std::any_of(args.begin(), args.end(), requires_grad) ||
         std::any_of(kwargs.begin(), kwargs.end(), [](const auto& kv) { return requires_grad(kv.second); });
}

// A value the recorder can be handed as it is: fakes, constants and containers of them. A module or an object would
// reach it with its real tensors, which would become graph constants (no gradient, no guard on their values).
bool recordable(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kConst:
    case VarKind::kTensor: return true;
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kDict:
    case VarKind::kSlice: return std::all_of(v->items.begin(), v->items.end(), recordable);
    default: return false;
  }
}

// Builtins whose answer depends on an argument's type alone: foldable when that type is guarded.
bool depends_on_type_only(PyObject* f) {
  for (const char* name : {"isinstance", "issubclass", "type", "callable"})
    if (f == builtin(name)) return true;
  return false;
}

}  // namespace

[[noreturn]] void rethrow_python(const std::string& context) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string message = context;
  if (value) {
    PyObject* s = PyObject_Str(value);
    message += std::string(": ") + ((PyTypeObject*)type)->tp_name + ": " + (s ? PyUnicode_AsUTF8(s) : "?");
    Py_XDECREF(s);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
  KILN_UNSUPPORTED() << message;
}

VarPtr Tracer::call_recorded(PyObject* fn, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  SymbolicInts* symbolic = this->symbolic();
  if (symbolic) {
    if (VarPtr size = symbolic_size_call(fn, args, kwargs)) return size;
    // Composites that compute sizes in C++ (narrow's end, chunk's split size): their Python twins, inlined, so those
    // ints are expressions over the size symbols (kiln/_tracing_composites.py).
    if (PyObject* twin = PyDict_GetItemWithError(helper("SYMBOLIC_TWINS"), fn))
      return call(make_const(twin), std::vector<VarPtr>(args), KwArgs(kwargs));
    PyErr_Clear();
  }
  // Ints handed to the call go to the recorder unpinned; finish() finds them in the nodes it records (symbolic_ints.h).
  std::vector<PassedInt> passed;
  if (symbolic) {
    for (const VarPtr& a : args) collect_passed_ints(a, passed);
    for (const auto& kw : kwargs) collect_passed_ints(kw.second, passed);
  }
  // An array pinned by its type only (a numpy array argument): the call would bake the first call's contents.
  for (const VarPtr& a : args) refuse_unguarded_data(a, fn);
  for (const auto& kw : kwargs) refuse_unguarded_data(kw.second, fn);
  std::optional<NoPinScope> no_pin;
  if (!passed.empty()) no_pin.emplace();
  const int first_node = passed.empty() ? 0 : recorded_nodes();
  PyObject* py_args = PyTuple_New(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* a = to_python(args[i]);
    if (!a) {
      Py_DECREF(py_args);
      rethrow_python("converting an argument");
    }
    PyTuple_SET_ITEM(py_args, i, a);
  }
  PyObject* py_kwargs = PyDict_New();
  for (const auto& [name, value] : kwargs) {
    PyObject* v = to_python(value);
    if (!v) {
      Py_DECREF(py_args);
      Py_DECREF(py_kwargs);
      rethrow_python("converting a keyword argument");
    }
    PyDict_SetItem(py_kwargs, name, v);
    Py_DECREF(v);
  }
  PyObject* result = PyObject_CallMethod(recorder_, "call", "OOO", fn, py_args, py_kwargs);
  Py_DECREF(py_args);
  Py_DECREF(py_kwargs);
  if (!result) rethrow_python("calling " + name_of(fn) + " on fake tensors");
  if (!passed.empty()) {
    no_pin.reset();
    symbolic->note_call(first_node, recorded_nodes(), std::move(passed), name_of(fn), is_number_or_numbers(result));
  }
  VarPtr out = wrap_result(result);
  Py_DECREF(result);
  return out;
}

VarPtr Tracer::call(const VarPtr& fn, std::vector<VarPtr> args, KwArgs kwargs) {
  bool construct = false;
  VarPtr made = call_python_construct(fn, args, kwargs, &construct);
  if (construct) return made;
  if (VarPtr logged = defer_log_call(fn, args, kwargs)) return logged;
  switch (fn->kind) {
    case VarKind::kModule: return call_module(fn, std::move(args), std::move(kwargs));
    case VarKind::kUserObject: return call_user_object(fn, std::move(args), std::move(kwargs));
    case VarKind::kMethod: {
      if (fn->items[0]->is(VarKind::kUserObject) && !PyFunction_Check(fn->value))
        return call_user_object(fn, std::move(args), std::move(kwargs));
      if (fn->items[0]->is(VarKind::kTensor)) {
        if (args.size() == 1 && name_of(fn->value) == "TensorBase.new_tensor") return new_tensor(fn->items[0], args[0], kwargs);
        args.insert(args.begin(), fn->items[0]);
        return call_recorded(fn->value, args, kwargs);
      }
      if (fn->items[0]->is(VarKind::kObject)) {
        // Read-only methods of a record (keys, to_tuple, __getitem__) run on its trace-time instance; its
        // other Python methods are inlined like any method; its other C methods (update) are refused.
        bool python = PyFunction_Check(fn->value);
        PyObject* name = python ? ((PyFunctionObject*)fn->value)->func_name : PyDescr_NAME(fn->value);
        int read_only = PySet_Contains(helper("RECORD_READ_METHODS"), name);
        if (read_only < 0) PyErr_Clear();
        if (!python || read_only == 1) {
          if (!kwargs.empty()) KILN_UNSUPPORTED() << "keyword arguments to a method of a " << fn->items[0]->describe();
          return call_record_method(fn->items[0], name, args);
        }
      }
      if (PyFunction_Check(fn->value))
        if (VarPtr read = call_environ_method(fn->items[0], PyUnicode_AsUTF8(((PyFunctionObject*)fn->value)->func_name),
                                              args, kwargs))
          return read;
      bool grad_mode = false;
      VarPtr switched = call_grad_mode(fn->value, fn->items[0], args, kwargs, &grad_mode);
      if (grad_mode) return switched;
      if (fn->value == object_getattribute() && args.size() == 1 && kwargs.empty())
        return generic_getattr(fn->items[0], args[0]);  // super().__getattribute__(name)
      if (!PyFunction_Check(fn->value)) {
        if (fn->items[0]->is(VarKind::kList) && name_of(fn->value) == "list.sort" && args.empty())
          return sort_list(fn->items[0], kwargs);
        if (fn->items[0]->is(VarKind::kDict) && name_of(fn->value) == "dict.update" && !kwargs.empty() && args.size() <= 1)
          return update_dict_with_keywords(fn->items[0], std::move(args), kwargs);
        if (!kwargs.empty()) KILN_UNSUPPORTED() << "keyword arguments to a container method";
        return call_container_method(fn->items[0], name_of(fn->value), std::move(args));
      }
      // A custom torch.autograd.Function's apply (a classmethod bound to the subclass): eager runs the subclass's
      // forward under autograd's own node, whose backward is the user's Python. Where no gradient can flow, the
      // forward (under no_grad, as eager runs it) is inlined.
      if (PyObject* owner = fn->items[0]->is(VarKind::kConst) ? fn->items[0]->value : nullptr;
          owner && PyType_Check(owner) && owner != helper("AUTOGRAD_FUNCTION") &&
          PyObject_IsSubclass(owner, helper("AUTOGRAD_FUNCTION")) == 1) {
        const bool apply = fn->value == helper("AUTOGRAD_FUNCTION_APPLY");
        if (apply && (!grad_enabled() || !any_requires_grad(args, kwargs))) {
          PyObject* traceable = detail::check(PyObject_CallOneArg(helper("forward_is_traceable"), owner), "forward_is_traceable");
          const bool inline_forward = traceable == Py_True;
          Py_DECREF(traceable);
          if (inline_forward) {
            args.insert(args.begin(), fn->items[0]);
            return call(make_const(helper("apply_without_grad")), std::move(args), std::move(kwargs));
          }
        }
        KILN_UNSUPPORTED() << "call of " << ((PyTypeObject*)owner)->tp_name << "."
                           << (PyFunction_Check(fn->value)
                                   ? PyUnicode_AsUTF8(((PyFunctionObject*)fn->value)->func_name)
                                   : "apply")
                           << ", a custom torch.autograd.Function (it runs eagerly, with its own backward)";
      }
      PyErr_Clear();
      args.insert(args.begin(), fn->items[0]);
      return inline_function(fn->value, std::move(args), std::move(kwargs));
    }
    case VarKind::kConst: break;
    default: KILN_UNSUPPORTED() << "calling a " << fn->describe();
  }
  PyObject* f = fn->value;
  // Builtins only (types and C functions: their == runs no user code).
  if (PyCFunction_Check(f) || PyType_Check(f)) {
    // operator.add(a, b) and the other operator functions of BINARY_OP and COMPARE_OP: as the operator.
    if (args.size() == 2 && kwargs.empty() &&
        (PySequence_Contains(helper("BINARY_OPS"), f) == 1 || PySequence_Contains(helper("COMPARE_OPS"), f) == 1))
      return binary(f, args[0], args[1]);
    // map, filter, itertools' chain/product/islice/count, functools.reduce: their Python twins (kiln._tracing),
    // inlined. A bound class method (chain.from_iterable) is a new object on every read, equal to its key.
    if (PyObject* twin = PyDict_GetItemWithError(helper("TRACED_REPLACEMENTS"), f))
      return call(make_const(twin), std::move(args), std::move(kwargs));
    PyErr_Clear();
  }
  // A weak reference read from outside (RNNBase._flat_weight_refs): its referent, read through it and guarded as any
  // value reached that way (a parameter is the same object as the module's; a dead one is None).
  if (fn->source && PyWeakref_CheckRef(f) && args.empty() && kwargs.empty()) return wrap_referent(fn);
  if (fn->by_type) KILN_UNSUPPORTED() << "calling " << name_of(f) << ", a method bound to an object not pinned by identity";
  if (PyObject_IsInstance(f, helper("CACHED_FUNCTION_TYPES")) == 1) return call_cached_function(f, std::move(args), std::move(kwargs));
  PyErr_Clear();
  if (PyFunction_Check(f)) {
    PyObject* dict = ((PyFunctionObject*)f)->func_dict;
    if (dict && PyDict_GetItemString(dict, "_kiln_disabled"))
      KILN_UNSUPPORTED() << "call of " << name_of(f) << ", a function under kiln.disable";
    // torch.compiler.disable / torch._dynamo.disable wrappers: the function runs eagerly, as under torch.compile,
    // and the wrapper (which switches torch's own frame evaluator) is never traced.
    if (dict && PyDict_GetItemString(dict, "_torchdynamo_disable"))
      KILN_UNSUPPORTED() << "call of " << name_of(f) << ", a function under torch.compiler.disable";
    // Functions torch wraps with torch._disable_dynamo (torch.utils.checkpoint, Optimizer.zero_grad, ...) are
    // torch.compiler.disable'd from their first call: the call runs eagerly, kiln suspended for what it calls, and
    // the wrapper is not traced. Before, the trace went into the wrapper and broke somewhere inside it, at whatever
    // its first call found (the import of torch._dynamo, a DisableContext, or kiln's ready wrapper,
    // _torch_meta.avoid_dynamo_import). For activation checkpointing this is what keeps results right: its backward
    // recomputes the function eagerly and must save the same tensors as its forward did (CheckpointError otherwise).
    PyObject* qualname = ((PyCodeObject*)PyFunction_GET_CODE(f))->co_qualname;
    if (PyUnicode_Check(qualname) && PyUnicode_CompareWithASCIIString(qualname, "_disable_dynamo.<locals>.inner") == 0)
      KILN_UNSUPPORTED() << "call of " << name_of(f) << ", a function torch disables for compilers "
                         << "(torch._disable_dynamo): it runs eagerly";
  }
  bool handled = false;
  VarPtr r = call_grad_mode(f, nullptr, args, kwargs, &handled);
  if (handled) return r;
  r = call_builtin(f, args, kwargs, &handled);
  if (handled) return r;
  r = construct_record(f, args, kwargs, &handled);
  if (handled) return r;
  if (f == object_getattribute() && args.size() == 2 && kwargs.empty()) return generic_getattr(args[0], args[1]);
  if (PyExceptionClass_Check(f)) return construct_exception(f, args, kwargs);
  PyObject* eager_only = PyObject_CallOneArg(helper("eager_only_reason"), f);
  if (!eager_only) rethrow_python("classifying a callable");
  if (eager_only != Py_None) {
    const std::string why = PyUnicode_Check(eager_only) ? PyUnicode_AsUTF8(eager_only) : "";
    Py_DECREF(eager_only);
    KILN_UNSUPPORTED() << "call of " << name_of(f) << ", " << why;
  }
  Py_DECREF(eager_only);
  PyObject* is_torch = PyObject_CallOneArg(helper("is_torch_callable"), f);
  if (!is_torch) rethrow_python("classifying a callable");
  bool torch_callable = is_torch == Py_True;
  Py_DECREF(is_torch);
  if (torch_callable) return call_recorded(f, args, kwargs);
  if (PyFunction_Check(f) && allowed_in_graph(f, args, kwargs)) return call_recorded(f, args, kwargs);
  if (PyFunction_Check(f)) return inline_function(f, std::move(args), std::move(kwargs), fn->source);
  if (PyType_Check(f) && ((PyTypeObject*)f)->tp_init != nullptr && !PyExceptionClass_Check(f))
    return construct_user_object(f, fn->source, std::move(args), std::move(kwargs));
  if (PyMethod_Check(f)) {
    PyObject* self = PyMethod_GET_SELF(f);
    args.insert(args.begin(), wrap(self, nullptr));
    return inline_function(PyMethod_GET_FUNCTION(f), std::move(args), std::move(kwargs));
  }
  KILN_UNSUPPORTED() << "calling " << name_of(f) << " (" << Py_TYPE(f)->tp_name << ") is not traced yet";
}

bool Tracer::allowed_in_graph(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  // torch.compiler.allow_in_graph(f): Dynamo writes the call into its graph without reading f's code. kiln's
  // equivalent is to run f whole on the fakes, recording the ops it reaches (its Python, a print included, runs
  // once, at trace time), rather than inlining it or breaking the graph at what it holds.
  PyObject* allowed = PyObject_CallOneArg(helper("is_allowed_in_graph"), f);
  if (!allowed) rethrow_python("asking whether a function is allowed in the graph");
  Py_DECREF(allowed);
  if (allowed != Py_True) return false;
  if (!std::all_of(args.begin(), args.end(), recordable)) return false;
  return std::all_of(kwargs.begin(), kwargs.end(), [](const auto& kw) { return recordable(kw.second); });
}

VarPtr Tracer::call_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs, bool* handled) {
  *handled = true;
  size_t n = args.size();
  if (VarPtr out = user_object_builtin(f, args, kwargs)) return out;
  if (VarPtr out = set_builtin(f, args, kwargs)) return out;
  if (VarPtr out = call_identity_or_copy(f, args, kwargs)) return out;
  if (SymbolicInts* symbolic = this->symbolic()) {
    if ((f == builtin("min") || f == builtin("max")) && kwargs.empty() &&
        std::any_of(args.begin(), args.end(), [](const VarPtr& a) { return a->is(VarKind::kSymInt); }))
      if (VarPtr out = symbolic->min_max(f == builtin("max"), args)) return out;
    if (f == builtin("len") && n == 1 && kwargs.empty() && args[0]->is(VarKind::kTensor))
      if (VarPtr out = symbolic_size_call(f, args, kwargs)) return out;
  }
  if (f == builtin("len") && n == 1 && kwargs.empty()) {
    const VarPtr& x = args[0];
    if (x->is(VarKind::kTuple) || x->is(VarKind::kList) || x->is(VarKind::kDict) || x->is(VarKind::kSet))
      return make_const_steal(PyLong_FromSize_t(x->items.size()));
    if (x->is(VarKind::kTensor) || x->is(VarKind::kModule) || x->is(VarKind::kObject)) {
      // A container module's length is guarded as its iteration is (its keys, ParameterList's _size), so an
      // append recompiles; another module's __len__ is not traced.
      if (x->is(VarKind::kModule)) guard_container_items(x);
      Py_ssize_t len = PyObject_Length(x->value);
      if (len < 0) rethrow_python("len()");
      return make_const_steal(PyLong_FromSsize_t(len));
    }
  }
  if (f == builtin("callable") && n == 1 && kwargs.empty()) {
    // Settled by the value's kind, or by its type for a value the trace holds (guarded by identity or type).
    const VarPtr& x = args[0];
    switch (x->kind) {
      case VarKind::kTensor:
      case VarKind::kTuple:
      case VarKind::kList:
      case VarKind::kDict:
      case VarKind::kSet:
      case VarKind::kIterator:
      case VarKind::kSlice:
      case VarKind::kGenerator: return make_const(Py_False);
      case VarKind::kModule:
      case VarKind::kMethod:
      case VarKind::kFunction:
      case VarKind::kPartial: return make_const(Py_True);
      case VarKind::kUserObject: return make_const(python_special_method(x, "__call__") ? Py_True : Py_False);
      case VarKind::kConst:
      case VarKind::kObject:
        if (x->value) return make_const(PyCallable_Check(x->value) ? Py_True : Py_False);
        break;
      default: break;
    }
  }
  if (f == builtin("isinstance") && n == 2 && kwargs.empty() && is_constant(args[1]) && !holds_object_pinned_by_type(args[1])) {
    const VarPtr& x = args[0];
    // A class or a tuple of classes (`isinstance(m, (torch.Tensor, BlockMask))`: a tuple the trace built)
    if (!x->is(VarKind::kTensor) && !x->is(VarKind::kUserObject) && !x->is(VarKind::kTuple) && !x->is(VarKind::kList) &&
        !x->is(VarKind::kDict) && !x->is(VarKind::kSet) && !x->value)
      KILN_UNSUPPORTED() << "isinstance of a " << x->describe();
    PyObject* cls = to_python(args[1]);
    if (!cls) rethrow_python("isinstance's classes");
    int r;
    if (x->is(VarKind::kTensor) || x->is(VarKind::kUserObject) || x->is(VarKind::kSet)) {
      r = PyObject_IsSubclass((PyObject*)x->real_type, cls);
    } else if (x->is(VarKind::kTuple) || x->is(VarKind::kList) || x->is(VarKind::kDict)) {
      PyTypeObject* t = x->is(VarKind::kTuple) ? (x->real_type ? x->real_type : &PyTuple_Type)
                        : x->is(VarKind::kList) ? (x->real_type ? x->real_type : &PyList_Type)
                                                : (x->real_type ? x->real_type : &PyDict_Type);
      r = PyObject_IsSubclass((PyObject*)t, cls);
    } else {
      r = PyObject_IsInstance(x->value, cls);
    }
    Py_DECREF(cls);
    if (r < 0) rethrow_python("isinstance");
    return make_const(r ? Py_True : Py_False);
  }
  if ((f == builtin("getattr") || f == builtin("hasattr")) && (n == 2 || n == 3) && kwargs.empty() && args[1]->is(VarKind::kConst) &&
      PyUnicode_Check(args[1]->value)) {
    bool has = f == builtin("hasattr");
    if (args[0]->value && !args[0]->is(VarKind::kTensor))
      if (VarPtr stored = stored_value(args[0]->value, args[1]->value)) return has ? make_const(Py_True) : stored;
    // Attribute existence is settled on the real object; the value goes through get_attr (guards).
    if (args[0]->value && !args[0]->is(VarKind::kTensor)) {
      int exists = PyObject_HasAttr(args[0]->value, args[1]->value);
      if (args[0]->source) {
        // Another instance of the type, or this one later (`m.extra = ...` on a module pinned by identity), may
        // differ: the answer is guarded (a read of the attribute through its source when present, an absence
        // check when not).
        if (!exists) guards_->add_has_no_attr(args[0]->source, PyUnicode_AsUTF8(args[1]->value));
        else if (has) get_attr(args[0], args[1]->value);
      }
      if (has) return make_const(exists ? Py_True : Py_False);
      if (!exists && n == 3) return args[2];
    }
    if (args[0]->is(VarKind::kTensor) && !_PyType_Lookup(args[0]->real_type, args[1]->value)) {
      // An attribute the program may have set on the real tensor: asked of it, not of the fake.
      bool found = false;
      VarPtr v = tensor_instance_attr(args[0], args[1]->value, &found);
      if (has) return make_const(found ? Py_True : Py_False);
      if (found) return v;
      if (n == 3) return args[2];
    }
    if (has) {
      if (args[0]->is(VarKind::kTensor)) return make_const(PyObject_HasAttr(args[0]->value, args[1]->value) ? Py_True : Py_False);
    } else {
      return get_attr(args[0], args[1]->value);
    }
  }
  // A set's items in its real set's order (a constant one too: its history decides that order).
  if ((f == builtin("tuple") || f == builtin("list")) && n == 1 && kwargs.empty() && (!is_constant(args[0]) || args[0]->is(VarKind::kSet))) {
    return make_sequence(f == builtin("tuple") ? VarKind::kTuple : VarKind::kList, iterate(args[0]));
  }
  if (VarPtr out = iteration_builtin(f, args, kwargs)) return out;
  // Pure builtins and math/operator functions of constants run for real.
  if (contains(helper("PURE_BUILTINS"), f)) {
    bool all_const = true;
    // An iterator argument (list(gen), next(it)) would be consumed at trace time: not folded.
    // An exception made in the trace from constants (str(e), isinstance(e, ...)) folds like a constant.
    auto constant = [](const VarPtr& a) {
      if (a->is(VarKind::kObject) && a->value && PyExceptionInstance_Check(a->value))
        return std::all_of(a->items.begin(), a->items.end(), [](const VarPtr& item) { return is_constant(item); });
      return is_constant(a);
    };
    for (const VarPtr& a : args) all_const = all_const && constant(a) && !(a->value && PyIter_Check(a->value));
    for (const auto& kv : kwargs) all_const = all_const && constant(kv.second);
    // str(exc), repr(config), len(obj) of an object guarded by type alone would replay the first call's answer.
    if (!depends_on_type_only(f)) {
      for (const VarPtr& a : args) all_const = all_const && !holds_object_pinned_by_type(a);
      for (const auto& kv : kwargs) all_const = all_const && !holds_object_pinned_by_type(kv.second);
    }
    if (all_const) {
      PyObject* r = call_on_values(f, args, kwargs);
      // On constants eager raises the same, and the traced code may catch it. getattr's misses stay graph breaks:
      // nothing guards that the object still lacks the attribute.
      if (!r && f == builtin("getattr")) rethrow_python("calling getattr");
      if (!r) raise_pending("calling " + name_of(f));
      // A stateful result (iter(), zip(), enumerate(), set(), dict()) folded into a constant would be the
      // same object on every call, consumed or mutated by the first: the call runs eagerly instead.
      if (PyIter_Check(r) || PySet_Check(r) || PyDict_Check(r) || PyByteArray_Check(r)) {
        Py_DECREF(r);
        *handled = false;
        return nullptr;
      }
      // type(obj) keeps a source (type(obj)), so that what the trace reads off the class is guarded.
      const bool type_of_sourced = f == builtin("type") && args.size() == 1 && kwargs.empty() && args[0]->source;
      VarPtr out = type_of_sourced ? make_const(r, Source::type_of(args[0]->source)) : wrap_result(r);
      Py_DECREF(r);
      return out;
    }
  }
  *handled = false;
  return nullptr;
}

PyObject* Tracer::object_getattribute() {
  // Through getattr, not tp_dict: 3.12 keeps static builtin types' dicts in the interpreter (tp_dict is NULL).
  static PyObject* slot = PyObject_GetAttrString((PyObject*)&PyBaseObject_Type, "__getattribute__");
  return slot;
}

VarPtr Tracer::generic_getattr(const VarPtr& obj, const VarPtr& name) {
  // object.__getattribute__(obj, name), as a class's own __getattribute__ calls it (HF's configs map aliases, then
  // ask super()): read the attribute as the trace reads any, when that gives the very object the generic lookup
  // gives (the override passes this name through), so the guards of an ordinary read cover it.
  if (obj->is(VarKind::kUserObject) && name->is(VarKind::kConst) && PyUnicode_Check(name->value))
    return raw_user_object_attr(obj, name->value);  // its table, whatever its class's override does
  if (!name->is(VarKind::kConst) || !PyUnicode_Check(name->value) || !obj->value ||
      !(obj->is(VarKind::kConst) || obj->is(VarKind::kModule)))
    KILN_UNSUPPORTED() << "object.__getattribute__ of a " << obj->describe();
  PyObject* generic = PyObject_GenericGetAttr(obj->value, name->value);
  if (!generic) rethrow_python("object.__getattribute__");
  PyObject* through = PyObject_GetAttr(obj->value, name->value);
  if (!through) PyErr_Clear();
  const bool same = through == generic;
  Py_DECREF(generic);
  Py_XDECREF(through);
  if (!same) KILN_UNSUPPORTED() << "object.__getattribute__ bypassing a different " << Py_TYPE(obj->value)->tp_name << ".__getattribute__";
  return get_attr(obj, name->value);
}

VarPtr Tracer::construct_exception(PyObject* cls, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  // An exception of a class with the built-in constructor (ValueError, most user subclasses), on constants: made
  // for real at trace time, and rebuilt from its class and arguments wherever it leaves the trace.
  bool constant = kwargs.empty() && plain_exception_class(cls);
  for (const VarPtr& a : args) constant = constant && is_constant(a) && !holds_object_pinned_by_type(a);
  if (!constant) KILN_UNSUPPORTED() << "constructing the exception " << name_of(cls) << " (Python __init__ or traced arguments)";
  PyObject* made = call_on_values(cls, args, kwargs);
  if (!made) raise_pending("constructing " + name_of(cls));
  VarPtr out = exception_var(made);
  Py_DECREF(made);
  return out;
}

VarPtr Tracer::call_container_method(const VarPtr& self, const std::string& qualname, std::vector<VarPtr> args) {
  std::string name = qualname.substr(qualname.rfind('.') + 1);
  if (self->is(VarKind::kSet)) return set_method(self, name, args);
  size_t n = args.size();
  auto key_index = [&](const VarPtr& key) -> long {
    if (!key->is(VarKind::kConst)) KILN_UNSUPPORTED() << "dict key that is a " << key->describe();
    for (size_t i = 0; i < self->keys.size(); ++i) {
      int eq = PyObject_RichCompareBool(self->keys[i], key->value, Py_EQ);
      if (eq < 0) PyErr_Clear();
      if (eq == 1) return (long)i;
    }
    return -1;
  };
  if (self->is(VarKind::kDict)) {
    if (name == "get" && (n == 1 || n == 2)) {
      long i = key_index(args[0]);
      return i >= 0 ? self->items[i] : (n == 2 ? args[1] : make_const(Py_None));
    }
    if ((name == "keys" || name == "values" || name == "items") && n == 0) {
      std::vector<VarPtr> out;
      for (size_t i = 0; i < self->keys.size(); ++i) {
        VarPtr k = make_const(self->keys[i]);
        out.push_back(name == "keys" ? k : name == "values" ? self->items[i] : make_sequence(VarKind::kTuple, {k, self->items[i]}));
      }
      // A snapshot of the view, typed as it (type(), isinstance, set operators); values() is a plain list.
      VarPtr view = make_sequence(VarKind::kList, std::move(out));
      if (name != "values") view->real_type = name == "keys" ? &PyDictKeys_Type : &PyDictItems_Type;
      return view;
    }
    if (name == "__getitem__" && n == 1) return subscript(self, args[0]);
    if (name == "__contains__" && n == 1) return make_const(key_index(args[0]) >= 0 ? Py_True : Py_False);
    if (name == "__len__" && n == 0) return make_const_steal(PyLong_FromSize_t(self->items.size()));
    if (name == "copy" && n == 0) {
      std::vector<PyObject*> keys;
      for (PyObject* k : self->keys) keys.push_back(Py_NewRef(k));
      return make_dict(std::move(keys), self->items);
    }
    if (VarPtr out = mutate_dict(self, name, args)) return out;
  }
  const bool list_mutation = name == "append" || name == "extend" || name == "insert" || name == "pop" ||
                             name == "reverse" || name == "clear" || name == "remove";
  if (self->is(VarKind::kList) && list_mutation && claim_container(self)) {
    if (name == "append" && n == 1) {
      self->items.push_back(args[0]);
      return make_const(Py_None);
    }
    if (name == "extend" && n == 1) {
      for (VarPtr& item : iterate(args[0])) self->items.push_back(item);
      return make_const(Py_None);
    }
    if (name == "insert" && n == 2 && args[0]->is(VarKind::kConst) && PyLong_Check(args[0]->value)) {
      long long at = PyLong_AsLongLong(args[0]->value), size = (long long)self->items.size();
      at = at < 0 ? std::max(0LL, at + size) : std::min(at, size);
      self->items.insert(self->items.begin() + at, args[1]);
      return make_const(Py_None);
    }
    if (name == "pop" && n == 0 && !self->items.empty()) {
      VarPtr last = self->items.back();
      self->items.pop_back();
      return last;
    }
    if (name == "reverse" && n == 0) {
      std::reverse(self->items.begin(), self->items.end());
      return make_const(Py_None);
    }
    if (name == "clear" && n == 0) {
      self->items.clear();
      return make_const(Py_None);
    }
    if (name == "remove" && n == 1 && is_constant(args[0]) && is_constant(self)) {
      PyObject* seq = to_python(self);
      PyObject* value = to_python(args[0]);
      const Py_ssize_t i = seq && value ? PySequence_Index(seq, value) : -1;
      Py_XDECREF(seq);
      Py_XDECREF(value);
      if (i < 0) raise_pending("list.remove");  // ValueError: x not in list, as in eager
      self->items.erase(self->items.begin() + i);
      return make_const(Py_None);
    }
  }
  if ((self->is(VarKind::kList) || self->is(VarKind::kTuple)) && name == "count" && n == 1 && is_constant(self) &&
      is_constant(args[0])) {
    PyObject* seq = to_python(self);
    PyObject* r = PyObject_CallMethod(seq, "count", "N", to_python(args[0]));
    Py_DECREF(seq);
    if (!r) rethrow_python("count()");
    return make_const_steal(r);
  }
  if (self->is(VarKind::kList) && name == "copy" && n == 0) return make_sequence(VarKind::kList, self->items);
  if ((self->is(VarKind::kList) || self->is(VarKind::kTuple)) && name == "index" && n == 1 && is_constant(self)) {
    PyObject* seq = to_python(self);
    PyObject* r = PyObject_CallMethod(seq, "index", "N", to_python(args[0]));
    Py_DECREF(seq);
    if (!r) rethrow_python("index()");
    return make_const_steal(r);
  }
  KILN_UNSUPPORTED() << "method " << name << " of a " << self->describe() << (self->source ? " from outside the trace" : "");
}

VarPtr Tracer::call_module(const VarPtr& module, std::vector<VarPtr> args, KwArgs kwargs) {
  PyObject* m = module->value;
  PyObject* kind_obj = PyObject_CallOneArg(helper("module_call_kind"), m);
  if (!kind_obj) rethrow_python("inspecting a module");
  std::string kind = PyUnicode_AsUTF8(kind_obj);
  Py_DECREF(kind_obj);
  if (kind == "hooks") KILN_UNSUPPORTED() << "calling a module with hooks or a replaced forward (" << Py_TYPE(m)->tp_name << ")";
  if (kind == "untraced")
    KILN_UNSUPPORTED() << "calling " << Py_TYPE(m)->tp_name << ", a torch.distributed or torch.nn.parallel "
                       << "wrapper: its forward runs eagerly (communication and its bookkeeping), the module it "
                       << "wraps is compiled as its own frame";
  if (module->source) {
    // Hooks added later must invalidate the trace: the hook dicts stay empty. Its class must stay too: the trace
    // inlined this class's forward, and `module.__class__ = Other` keeps the object (and its identity check).
    guards_->add_no_module_hooks(module->source);
    guards_->add_type(module->source, Py_TYPE(m));
  }
  if (kind == "sequential") {
    if (args.size() != 1 || !kwargs.empty()) KILN_UNSUPPORTED() << "nn.Sequential called with several arguments";
    VarPtr x = args[0];
    for (VarPtr& child : iterate(module)) x = call(child, {x}, {});
    return x;
  }
  if (kind == "leaf") {
    PyObject* state = PyObject_CallOneArg(helper("leaf_module_state"), m);
    if (!state) rethrow_python("reading a module's state");
    PyObject* tensors = PyTuple_GET_ITEM(state, 0);
    PyObject* constants = PyTuple_GET_ITEM(state, 1);
    if (!module->source) {
      // Made inside the trace (construct_stateless_module): its attributes come from the trace's constants.
      if (PyList_GET_SIZE(tensors) > 0) {
        Py_DECREF(state);
        KILN_UNSUPPORTED() << "a built-in module with tensors that was created inside the traced code";
      }
      constants = nullptr;
    }
    auto path_source = [&](PyObject* path, std::string* dotted) {
      SourcePtr s = module->source;
      Py_ssize_t len = PyList_GET_SIZE(path);
      for (Py_ssize_t i = 0; i < len; ++i) {
        PyObject* step = PyList_GET_ITEM(path, i);
        std::string slot = PyUnicode_AsUTF8(PyTuple_GET_ITEM(step, 0));
        std::string name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(step, 1));
        s = slot == "__dict__" ? Source::instance_dict(s, name) : Source::module_slot(s, slot, name);
        if (dotted) *dotted += (dotted->empty() ? "" : ".") + name;
      }
      return s;
    };
    PyObject* fakes = PyDict_New();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); ++i) {
      PyObject* entry = PyList_GET_ITEM(tensors, i);
      std::string dotted;
      SourcePtr s = path_source(PyTuple_GET_ITEM(entry, 0), &dotted);
      VarPtr t = wrap(PyTuple_GET_ITEM(entry, 1), s);
      PyDict_SetItemString(fakes, dotted.c_str(), t->value);
    }
    // The module's own __dict__ entries in one check; attributes elsewhere (a class default, a submodule's) each
    // keep a node of their own.
    PyObject* own = PyList_New(0);
    PyObject** module_dict = _PyObject_GetDictPtr(m);
    for (Py_ssize_t i = 0; constants && i < PyList_GET_SIZE(constants); ++i) {
      PyObject* entry = PyList_GET_ITEM(constants, i);
      PyObject* path = PyTuple_GET_ITEM(entry, 0);
      PyObject* value = PyTuple_GET_ITEM(entry, 1);
      if (PyList_GET_SIZE(path) == 1 && module_dict && *module_dict) {
        PyObject* step = PyList_GET_ITEM(path, 0);
        PyObject* name = PyTuple_GET_ITEM(step, 1);
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(step, 0), "__dict__") == 0 &&
            PyDict_GetItemWithError(*module_dict, name) == value) {
          Py_INCREF(name);
          PyUnicode_InternInPlace(&name);
          PyObject* pair = PyTuple_Pack(2, name, value);
          Py_DECREF(name);
          PyList_Append(own, pair);
          Py_DECREF(pair);
          continue;
        }
        if (PyErr_Occurred()) PyErr_Clear();
      }
      guards_->add_constant(path_source(path, nullptr), value);
    }
    if (PyList_GET_SIZE(own) > 0) guards_->add_dict_constants(module->source, PyList_AsTuple(own));
    Py_DECREF(own);
    Py_DECREF(state);
    PyObject* py_args = PyTuple_New(args.size());
    for (size_t i = 0; i < args.size(); ++i) PyTuple_SET_ITEM(py_args, i, to_python(args[i]));
    PyObject* py_kwargs = PyDict_New();
    for (const auto& [k, v] : kwargs) {
      PyObject* pv = to_python(v);
      PyDict_SetItem(py_kwargs, k, pv);
      Py_DECREF(pv);
    }
    PyObject* result = PyObject_CallFunctionObjArgs(helper("call_leaf_module"), recorder_, m, fakes, py_args,
                                                    py_kwargs, nullptr);
    Py_DECREF(fakes);
    Py_DECREF(py_args);
    Py_DECREF(py_kwargs);
    if (!result) rethrow_python(std::string("calling ") + Py_TYPE(m)->tp_name + " on fake tensors");
    VarPtr out = wrap_result(result);
    Py_DECREF(result);
    return out;
  }
  PyObject* forward = PyObject_GetAttrString((PyObject*)Py_TYPE(m), "forward");
  if (!forward) rethrow_python("module.forward");
  args.insert(args.begin(), module);
  VarPtr out = PyFunction_Check(forward) ? inline_function(forward, std::move(args), std::move(kwargs)) : nullptr;
  Py_DECREF(forward);
  if (!out) KILN_UNSUPPORTED() << "module forward is not a Python function";
  return out;
}

VarPtr Tracer::inline_function(PyObject* function, std::vector<VarPtr> args, KwArgs kwargs, SourcePtr source) {
  return inline_with_cells(function, std::move(args), std::move(kwargs), nullptr, std::move(source));
}

VarPtr Tracer::inline_with_cells(PyObject* function, std::vector<VarPtr> args, KwArgs kwargs,
                                 const std::vector<VarPtr>* cells, SourcePtr source) {
  if (depth_ >= kMaxInlineDepth) KILN_UNSUPPORTED() << "inlining deeper than " << kMaxInlineDepth << " calls";
  PyCodeObject* code = (PyCodeObject*)PyFunction_GET_CODE(function);
  if (code->co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR))
    KILN_UNSUPPORTED() << "calling the coroutine or async generator function " << name_of(function);
  int nlocalsplus = (int)PyTuple_GET_SIZE(code->co_localsplusnames);
  std::vector<VarPtr> locals(nlocalsplus);
  // A plain positional call of a plain signature binds directly (comprehensions too, whose `.0` parameter
  // inspect cannot bind).
  bool plain = kwargs.empty() && args.size() == (size_t)code->co_argcount && code->co_kwonlyargcount == 0 &&
               !(code->co_flags & (CO_VARARGS | CO_VARKEYWORDS));
  if (plain) {
    for (size_t i = 0; i < args.size(); ++i) locals[i] = args[i];
  } else {
    bind_arguments(function, std::move(args), kwargs, locals);
  }
  // Free variables: read through their cells, guarded (a nonlocal can be rebound between calls); a
  // function made in the trace brings its cells' Vars instead.
  std::vector<VarPtr> freevars;
  PyObject* closure = PyFunction_GET_CLOSURE(function);
  PyObject* freenames = PyCode_GetFreevars(code);
  for (Py_ssize_t j = 0; closure && j < PyTuple_GET_SIZE(closure); ++j) {
    if (cells) {
      freevars.push_back((*cells)[j]);
      continue;
    }
    PyObject* cell = PyTuple_GET_ITEM(closure, j);
    PyObject* value = PyCell_GET(cell);
    if (VarPtr stored = stored_value(cell, cell_contents_name())) {  // assigned earlier in the trace
      freevars.push_back(stored);
      continue;
    }
    if (source && value == function) {
      // A function that names itself (a wrapper's `type(self).forward is wrapper`, a recursive helper): its own
      // source, not one step deeper through its closure, which would grow by three steps per call and, in a
      // loop over layers, pass the 256-step limit (transformers' GradientCheckpointingLayer wrapper did).
      guards_->add_same_object(Source::attr(Source::index(Source::attr(source, "__closure__"), j), "cell_contents"), source);
      freevars.push_back(wrap(value, source));
      continue;
    }
    std::string label = std::string("<cell ") + PyUnicode_AsUTF8(PyTuple_GET_ITEM(freenames, j)) + ">";
    SourcePtr cell_source = source ? Source::index(Source::attr(source, "__closure__"), j) : Source::object(cell, label);
    freevars.push_back(value ? wrap(value, Source::attr(cell_source, "cell_contents")) : nullptr);
  }
  Py_XDECREF(freenames);
  PyObject* globals = PyFunction_GET_GLOBALS(function);
  PyObject* builtins = PyDict_GetItemString(globals, "__builtins__");
  if (builtins && PyModule_Check(builtins)) builtins = PyModule_GetDict(builtins);
  if (!builtins) builtins = root_.builtins;
  if (code->co_flags & CO_GENERATOR) {
    // Calling a generator function binds its arguments and runs nothing: the body runs as it is iterated.
    auto generator = std::make_shared<Var>();
    generator->kind = VarKind::kGenerator;
    generator->frame =
        std::make_shared<InstructionTranslator>(*this, code, globals, builtins, std::move(locals), std::move(freevars));
    generator_steps_.emplace_back(generator, root_step_);
    return generator;
  }
  ++depth_;
  struct DepthGuard {
    int& d;
    ~DepthGuard() { --d; }
  } guard{depth_};
  InstructionTranslator inner(*this, code, globals, builtins, std::move(locals), std::move(freevars));
  return inner.run();
}

VarPtr Tracer::generator_next(const VarPtr& generator) {
  KILN_ASSERT(generator->is(VarKind::kGenerator) && generator->frame) << "generator_next on a " << generator->describe();
  if (depth_ >= kMaxInlineDepth) KILN_UNSUPPORTED() << "inlining deeper than " << kMaxInlineDepth << " calls";
  ++depth_;  // its body is an inlined frame: never the root's, whatever the depth of the loop consuming it
  struct DepthGuard {
    int& d;
    ~DepthGuard() { --d; }
  } guard{depth_};
  return generator->frame->next_yield();
}

void Tracer::bind_arguments(PyObject* function, std::vector<VarPtr> args, const KwArgs& kwargs,
                            std::vector<VarPtr>& locals) {
  PyObject* kwnames = PyTuple_New(kwargs.size());
  for (size_t i = 0; i < kwargs.size(); ++i) {
    Py_INCREF(kwargs[i].first);
    PyTuple_SET_ITEM(kwnames, i, kwargs[i].first);
    args.push_back(kwargs[i].second);
  }
  size_t npositional = args.size() - kwargs.size();
  PyObject* binding = PyObject_CallFunction(helper("bind_arguments"), "OnO", function, (Py_ssize_t)npositional, kwnames);
  Py_DECREF(kwnames);
  if (!binding) rethrow_python("binding the arguments of " + name_of(function));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(binding); ++i) {
    PyObject* entry = PyList_GET_ITEM(binding, i);
    std::string tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(entry, 0));
    PyObject* payload = PyTuple_GET_ITEM(entry, 1);
    if (tag == "slot") {
      locals[i] = args[PyLong_AsSize_t(payload)];
    } else if (tag == "const") {
      // A mutable default (`acc=[]`) is one object shared by every call: it keeps a source (pinned by identity)
      // so that the trace never takes it for a container of its own: a mutation of it is replayed on it after the
      // graph (a list's or dict's, claim_container) or breaks.
      const bool shared = PyList_Check(payload) || PyDict_Check(payload) || PyAnySet_Check(payload) ||
                          PyByteArray_Check(payload);
      locals[i] = wrap(payload, shared ? Source::object(payload, "<default of " + name_of(function) + ">") : nullptr);
    } else if (tag == "tuple") {
      std::vector<VarPtr> items;
      for (Py_ssize_t k = 0; k < PyList_GET_SIZE(payload); ++k)
        items.push_back(args[PyLong_AsSize_t(PyList_GET_ITEM(payload, k))]);
      locals[i] = make_sequence(VarKind::kTuple, std::move(items));
    } else {
      std::vector<PyObject*> keys;
      std::vector<VarPtr> values;
      for (Py_ssize_t k = 0; k < PyList_GET_SIZE(payload); ++k) {
        PyObject* kv = PyList_GET_ITEM(payload, k);
        Py_INCREF(PyTuple_GET_ITEM(kv, 0));
        keys.push_back(PyTuple_GET_ITEM(kv, 0));
        values.push_back(args[PyLong_AsSize_t(PyTuple_GET_ITEM(kv, 1))]);
      }
      locals[i] = make_dict(std::move(keys), std::move(values));
    }
  }
  Py_DECREF(binding);
}

}  // namespace kiln::trace
