// FrameProgram: the hot path of a cache hit. A vectorcall Python type so the transformed code's
// CALL reaches C++ without argument tuples; inputs are fetched through their Sources, the compiled
// graph runs, and the frame's return value is rebuilt around its outputs.
#include "runtime/frame_program.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include "common/error.h"
#include "common/type_dict.h"
#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

OutputSpec::OutputSpec(OutputSpec&& o) noexcept
    : kind(o.kind), index(o.index), object(o.object), source(std::move(o.source)), children(std::move(o.children)) {
  o.object = nullptr;
}

OutputSpec& OutputSpec::operator=(OutputSpec&& o) noexcept {
  if (this != &o) {
    Py_XDECREF(object);
    kind = o.kind;
    index = o.index;
    object = o.object;
    source = std::move(o.source);
    children = std::move(o.children);
    o.object = nullptr;
  }
  return *this;
}

OutputSpec::~OutputSpec() { Py_XDECREF(object); }

namespace {

struct FrameProgramObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  FrameProgramSpec* spec;
  std::shared_ptr<CompiledGraph>* compiled;
};

struct BuildContext;
void remember(const OutputSpec& spec, PyObject* built, BuildContext& ctx);

struct BuildContext {
  std::vector<at::Tensor>& outputs;
  const SourceRoots& roots;
  std::vector<PyObject*> memo;  // owned: a value built once and used again (it may sit only in a call's arguments)
  PyObject* const* cells = nullptr;  // the frame's free-variable cells
  ~BuildContext() {
    for (PyObject* o : memo) Py_XDECREF(o);
  }
};

PyObject* build_output(const OutputSpec& spec, BuildContext& ctx);

SwapThreadCompiler swap_thread_compiler = nullptr;  // registered once, at kiln._C's initialisation

void* swap_registered(void* compiler) {
  KILN_ASSERT(swap_thread_compiler) << "kiln._C did not register the frame hook's swap (set_swap_thread_compiler)";
  return swap_thread_compiler(compiler);
}

// The calling thread has no compiler while this lives: Python run meanwhile takes the default evaluator.
struct SuspendCompiler {
  void* saved = swap_registered(nullptr);
  ~SuspendCompiler() { swap_thread_compiler(saved); }
};

PyObject* construct(const OutputSpec& spec, BuildContext& ctx) {
  PyObject* cls = PyTuple_GET_ITEM(spec.object, 0);
  PyObject* names = PyTuple_GET_ITEM(spec.object, 1);
  Py_ssize_t nkw = PyTuple_GET_SIZE(names), n = (Py_ssize_t)spec.children.size();
  std::vector<PyObject*> args;  // vectorcall layout: positional then keyword values
  args.reserve(n);
  for (const OutputSpec& child : spec.children) {
    PyObject* item = build_output(child, ctx);
    if (!item) {
      for (PyObject* a : args) Py_DECREF(a);
      return nullptr;
    }
    args.push_back(item);
  }
  PyObject* out;
  {
    // The constructor's frames (__init__, __post_init__) are the traced code's own work, already
    // accounted for: they run as plain Python, not as frames kiln would compile.
    SuspendCompiler suspend;
    out = PyObject_Vectorcall(cls, args.data(), n - nkw, nkw ? names : nullptr);
  }
  for (PyObject* a : args) Py_DECREF(a);
  if (out) remember(spec, out, ctx);
  return out;
}

// object.__new__(cls), then its __dict__ filled: no Python code runs (the class's __init__ ran in the trace).
PyObject* new_object(const OutputSpec& spec, BuildContext& ctx) {
  PyTypeObject* cls = (PyTypeObject*)PyTuple_GET_ITEM(spec.object, 0);
  PyObject* names = PyTuple_GET_ITEM(spec.object, 1);
  PyObject* no_args = PyTuple_New(0);
  PyObject* out = no_args ? PyBaseObject_Type.tp_new(cls, no_args, nullptr) : nullptr;
  Py_XDECREF(no_args);
  if (!out) return nullptr;
  remember(spec, out, ctx);
  PyObject* dict = PyObject_GenericGetDict(out, nullptr);
  for (size_t i = 0; dict && i < spec.children.size(); ++i) {
    PyObject* value = build_output(spec.children[i], ctx);
    int r = value ? PyDict_SetItem(dict, PyTuple_GET_ITEM(names, i), value) : -1;
    Py_XDECREF(value);
    if (r < 0) Py_CLEAR(dict);
  }
  if (!dict) {
    Py_DECREF(out);
    return nullptr;
  }
  Py_DECREF(dict);
  return out;
}

PyObject* build_output(const OutputSpec& spec, BuildContext& ctx) {
  std::vector<at::Tensor>& outputs = ctx.outputs;
  const SourceRoots& roots = ctx.roots;
  switch (spec.kind) {
    case OutputSpec::Kind::kRepeat: {
      PyObject* shared = spec.index < (int)ctx.memo.size() ? ctx.memo[spec.index] : nullptr;
      if (!shared) {
        PyErr_SetString(PyExc_RuntimeError, "kiln internal error: a repeated value was not built first");
        return nullptr;
      }
      Py_INCREF(shared);
      return shared;
    }
    case OutputSpec::Kind::kGraphOutput: return THPVariable_Wrap(outputs[spec.index]);
    case OutputSpec::Kind::kSource: return spec.source->resolve(roots);
    case OutputSpec::Kind::kBoundMethod: {
      PyObject* self = build_output(spec.children[0], ctx);
      if (!self) return nullptr;
      // CallMethodObjArgs, not CallMethod(.., "O", self): a tuple self would be spread into arguments.
      static PyObject* get = PyUnicode_InternFromString("__get__");
      PyObject* bound = PyObject_CallMethodObjArgs(spec.object, get, self, nullptr);
      Py_DECREF(self);
      return bound;
    }
    case OutputSpec::Kind::kConstant: Py_INCREF(spec.object); return spec.object;
    case OutputSpec::Kind::kCell: return Py_NewRef(ctx.cells[spec.index]);
    case OutputSpec::Kind::kTypedTuple: {
      PyObject* items = PyTuple_New(spec.children.size());
      if (!items) return nullptr;
      for (size_t i = 0; i < spec.children.size(); ++i) {
        PyObject* item = build_output(spec.children[i], ctx);
        if (!item) {
          Py_DECREF(items);
          return nullptr;
        }
        PyTuple_SET_ITEM(items, i, item);
      }
      PyObject* out = make_structured_tuple((PyTypeObject*)spec.object, items);
      Py_DECREF(items);
      return out;
    }
    case OutputSpec::Kind::kConstruct: return construct(spec, ctx);
    case OutputSpec::Kind::kNewObject: return new_object(spec, ctx);
    case OutputSpec::Kind::kStores: {
      PyObject* out = build_output(spec.children[0], ctx);
      if (!out) return nullptr;
      // nn.Module.__setattr__ is Python: it runs as plain Python, as in eager, not as a frame to compile.
      SuspendCompiler suspend;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec.object); ++i) {
        PyObject* entry = PyTuple_GET_ITEM(spec.object, i);
        PyObject* target = build_output(spec.children[1 + 2 * i], ctx);
        PyObject* value = target ? build_output(spec.children[2 + 2 * i], ctx) : nullptr;
        int r = -1;
        if (value) {
          PyObject* name = PyTuple_GET_ITEM(entry, 0);
          switch (static_cast<StoreKind>(PyLong_AsLong(PyTuple_GET_ITEM(entry, 1)))) {
            case StoreKind::kAttribute: r = PyObject_SetAttr(target, name, value); break;
            case StoreKind::kItem: r = PyDict_SetItem(target, name, value); break;
            case StoreKind::kDictContents:  // the same dict object, with the items the trace left in it
              PyDict_Clear(target);
              r = PyDict_Update(target, value);
              break;
            case StoreKind::kListContents:  // the same list object, with the items the trace left in it
              r = PyList_SetSlice(target, 0, PyList_GET_SIZE(target), value);
              break;
            case StoreKind::kCall: {  // a deferred call (a log line): its result is None, dropped as eager drops it
              PyObject* result = PyObject_Call(PyTuple_GET_ITEM(value, 0), PyTuple_GET_ITEM(value, 1),
                                               PyTuple_GET_ITEM(value, 2));
              r = result ? 0 : -1;
              Py_XDECREF(result);
              break;
            }
          }
        }
        Py_XDECREF(target);
        Py_XDECREF(value);
        if (r < 0) {
          Py_DECREF(out);
          return nullptr;
        }
      }
      return out;
    }
    case OutputSpec::Kind::kTuple:
    case OutputSpec::Kind::kList: {
      bool tuple = spec.kind == OutputSpec::Kind::kTuple;
      PyObject* out = tuple ? PyTuple_New(spec.children.size()) : PyList_New(spec.children.size());
      if (!out) return nullptr;
      remember(spec, out, ctx);
      for (size_t i = 0; i < spec.children.size(); ++i) {
        PyObject* item = build_output(spec.children[i], ctx);
        if (!item) {
          Py_DECREF(out);
          return nullptr;
        }
        if (tuple)
          PyTuple_SET_ITEM(out, i, item);
        else
          PyList_SET_ITEM(out, i, item);
      }
      return out;
    }
    case OutputSpec::Kind::kDict: {
      PyObject* out = PyDict_New();
      if (!out) return nullptr;
      remember(spec, out, ctx);
      for (size_t i = 0; i < spec.children.size(); ++i) {
        PyObject* item = build_output(spec.children[i], ctx);
        if (!item || PyDict_SetItem(out, PyTuple_GET_ITEM(spec.object, i), item) < 0) {
          Py_XDECREF(item);
          Py_DECREF(out);
          return nullptr;
        }
        Py_DECREF(item);
      }
      return out;
    }
  }
  return nullptr;
}

// A list or dict reachable twice from the output is built once (memo slot `index`), before its items,
// so an item may refer back to it.
void remember(const OutputSpec& spec, PyObject* built, BuildContext& ctx) {
  if (spec.index < 0) return;
  if ((int)ctx.memo.size() <= spec.index) ctx.memo.resize(spec.index + 1, nullptr);
  Py_XSETREF(ctx.memo[spec.index], Py_NewRef(built));
}

// A graph may switch grad mode (traced grad-mode blocks) and then fail half-way; eager would have left
// those blocks through their __exit__, so the mode the frame was called in comes back on any error.
struct RestoreGradModeOnError {
  bool saved = at::GradMode::is_enabled();
  bool succeeded = false;
  ~RestoreGradModeOnError() {
    if (!succeeded) at::GradMode::set_enabled(saved);
  }
};

// `module`.`name` (a class of torch), or nullptr (a torch without it).
PyObject* torch_class(const char* module, const char* name) {
  PyObject* m = PyImport_ImportModule(module);
  PyObject* cls = m ? PyObject_GetAttrString(m, name) : nullptr;
  Py_XDECREF(m);
  if (!cls) PyErr_Clear();
  return cls;
}

// An ATen error as the Python exception eager raises for it (torch/csrc/Exceptions.h's mapping), with eager's message
// and without LibTorch's C++ backtrace: callers catch torch.OutOfMemoryError around a batch-size search,
// NotImplementedError for a dtype a kernel lacks, torch.linalg.LinAlgError for a singular matrix.
void set_python_error_as_torch_does(const c10::Error& e) {
  PyObject* owned = nullptr;
  PyObject* type = PyExc_RuntimeError;
  if (dynamic_cast<const c10::IndexError*>(&e)) type = PyExc_IndexError;
  else if (dynamic_cast<const c10::ValueError*>(&e)) type = PyExc_ValueError;
  else if (dynamic_cast<const c10::TypeError*>(&e)) type = PyExc_TypeError;
  else if (dynamic_cast<const c10::NotImplementedError*>(&e)) type = PyExc_NotImplementedError;
  else if (dynamic_cast<const c10::LinAlgError*>(&e)) owned = torch_class("torch._C", "_LinAlgError");
  else if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) owned = torch_class("torch", "OutOfMemoryError");
  else if (dynamic_cast<const c10::DistBackendError*>(&e)) owned = torch_class("torch._C", "_DistBackendError");
  PyErr_SetString(owned ? owned : type, e.what_without_backtrace());
  Py_XDECREF(owned);
}

PyObject* program_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* p = reinterpret_cast<FrameProgramObject*>(self);
  const FrameProgramSpec& spec = *p->spec;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != spec.num_locals_passed + spec.num_freevars_passed || kwnames) {
    PyErr_SetString(PyExc_TypeError, "kiln internal error: compiled frame called with the wrong arguments");
    return nullptr;
  }
  SourceRoots roots;
  roots.locals = args;
  roots.nlocals = spec.num_locals_passed;
  // The frame passes its free variables' cells: sources read their contents (borrowed, NULL when empty).
  PyObject* const* cells = args + spec.num_locals_passed;
  constexpr int kInlineFree = 8;  // no allocation per call for the usual closure
  PyObject* inline_values[kInlineFree];
  std::vector<PyObject*> many_values;
  PyObject** free_values = inline_values;
  if (spec.num_freevars_passed > kInlineFree) {
    many_values.resize(spec.num_freevars_passed);
    free_values = many_values.data();
  }
  for (int j = 0; j < spec.num_freevars_passed; ++j) free_values[j] = PyCell_Check(cells[j]) ? PyCell_GET(cells[j]) : nullptr;
  roots.freevars = free_values;
  roots.nfreevars = spec.num_freevars_passed;
  roots.globals = spec.globals;
  roots.builtins = spec.builtins;
  RestoreGradModeOnError grad_mode;
  try {
    std::vector<at::Tensor> inputs;
    inputs.reserve(spec.inputs.size());
    SourceWalker walker(roots);
    for (const SourcePtr& source : spec.inputs) {
      PyObject* v = walker.resolve(*source);
      if (!v) return nullptr;
      if (!THPVariable_Check(v)) {
        Py_DECREF(v);
        PyErr_Format(PyExc_TypeError, "kiln internal error: graph input %s is not a tensor", source->describe().c_str());
        return nullptr;
      }
      inputs.push_back(THPVariable_Unpack(v));
      Py_DECREF(v);
    }
    std::vector<at::Tensor> outputs;
    CompiledGraph& compiled = **p->compiled;
    {
      // A graph traced under autocast holds autocast's casts as nodes: its ops must not be cast again. Only
      // around the graph: autocast's on/off state is this exclusion, and rebuilding the output may enter an
      // autocast block (a graph break inside one), which must outlive the call.
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      if (compiled.reenters_python()) {
        SuspendCompiler suspend;
        outputs = compiled.run(inputs);
      } else {
        outputs = compiled.run(inputs);
      }
    }
    BuildContext ctx{outputs, roots, {}, cells};
    PyObject* result = build_output(spec.output, ctx);
    grad_mode.succeeded = result != nullptr;
    return result;
  } catch (pybind11::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const c10::Error& e) {
    set_python_error_as_torch_does(e);
    return nullptr;
  } catch (const std::exception& e) {
    // ATen errors (c10::Error) and kiln errors surface as Python exceptions, never an abort.
    pybind11::detail::translate_exception(std::current_exception());
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

void program_dealloc(PyObject* self) {
  auto* p = reinterpret_cast<FrameProgramObject*>(self);
  delete p->spec;
  delete p->compiled;
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // instances of heap types own a reference to their type
}

PyObject* program_repr(PyObject* self) {
  auto* p = reinterpret_cast<FrameProgramObject*>(self);
  return PyUnicode_FromFormat("<kiln compiled frame %s: %zd inputs>", p->spec->name.c_str(), p->spec->inputs.size());
}

PyTypeObject* program_type() {
  static PyTypeObject* type = [] {
    static PyType_Slot slots[] = {
        {Py_tp_dealloc, (void*)program_dealloc},
        {Py_tp_call, (void*)PyVectorcall_Call},
        {Py_tp_repr, (void*)program_repr},
        {0, nullptr},
    };
    static PyMemberDef members[] = {
        {"__vectorcalloffset__", T_PYSSIZET, offsetof(FrameProgramObject, vectorcall), READONLY, nullptr},
        {nullptr, 0, 0, 0, nullptr},
    };
    static PyType_Slot all_slots[] = {slots[0], slots[1], slots[2], {Py_tp_members, members}, {0, nullptr}};
    static PyType_Spec spec = {"kiln.CompiledFrame", sizeof(FrameProgramObject), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, all_slots};
    return reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
  }();
  return type;
}

}  // namespace

void set_swap_thread_compiler(SwapThreadCompiler swap) { swap_thread_compiler = swap; }

PyObject* make_structured_tuple(PyTypeObject* type, PyObject* items) {
  static PyObject* sequence_fields = PyUnicode_InternFromString("n_sequence_fields");
  PyObject* dict = type_dict(type);
  PyObject* marker = dict ? PyDict_GetItemWithError(dict, sequence_fields) : nullptr;
  Py_XDECREF(dict);
  if (marker) return PyObject_CallOneArg((PyObject*)type, items);  // a structseq: type(sequence)
  if (PyErr_Occurred()) return nullptr;
  PyObject* args = PyTuple_Pack(1, items);
  if (!args) return nullptr;
  PyObject* out = PyTuple_Type.tp_new(type, args, nullptr);
  Py_DECREF(args);
  return out;
}

PyObject* make_frame_program(FrameProgramSpec spec, std::shared_ptr<CompiledGraph> compiled) {
  PyTypeObject* type = program_type();
  KILN_ASSERT(type) << "creating the CompiledFrame type";
  auto* p = PyObject_New(FrameProgramObject, type);
  if (!p) return nullptr;
  p->vectorcall = program_call;
  p->spec = new FrameProgramSpec(std::move(spec));
  p->compiled = new std::shared_ptr<CompiledGraph>(std::move(compiled));
  return reinterpret_cast<PyObject*>(p);
}

}  // namespace kiln::runtime
