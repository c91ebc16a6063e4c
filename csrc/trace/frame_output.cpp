// The frame's output: which graph outputs the tensors inside the returned value (or a graph break's live
// values) become, and the OutputSpec that rebuilds the Python value around them on every call.
#include <unordered_set>

#include "common/error.h"
#include "trace/graph_break.h"
#include "trace/tracer.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

namespace {

// A trace-time fake (a meta tensor) must never reach the user: eager would have returned real data.
// Reaching this is a tracer bug (a value that should have been symbolic was kept as a constant); the
// frame then falls back to eager, with the reason logged under KILN_LOGS=fallbacks.
void refuse_escaping_fake(PyObject* value, PyObject* holds_meta_tensor) {
  PyObject* r = PyObject_CallOneArg(holds_meta_tensor, value);
  if (!r) rethrow_python("checking an output for fake tensors");
  bool leaked = r == Py_True;
  Py_DECREF(r);
  KILN_ASSERT(!leaked) << "a " << Py_TYPE(value)->tp_name
                       << " holding trace-time fake (meta) tensors would leave the compiled frame";
}

// True when `v` holds (or is) an object made in the trace: outputs then keep every mutable value one object, as at a
// graph break (an object's list attribute returned beside it is that very list).
bool reaches_user_object(const VarPtr& v, std::unordered_set<const Var*>& seen) {
  if (!v || !seen.insert(v.get()).second) return false;
  if (v->is(VarKind::kUserObject)) return true;
  for (const VarPtr& item : v->items)
    if (reaches_user_object(item, seen)) return true;
  return false;
}

}  // namespace

bool Tracer::repeated(const VarPtr& v, runtime::OutputSpec& spec) {
  auto [it, first] = memo_slots_.emplace(v.get(), (int)memo_slots_.size());
  spec.index = it->second;
  if (!first) spec.kind = runtime::OutputSpec::Kind::kRepeat;
  return !first;
}

runtime::OutputSpec Tracer::dict_spec(const VarPtr& v, std::vector<PyObject*>& graph_outputs, bool break_output) {
  runtime::OutputSpec spec;
  if (v->real_type) {
    // An OrderedDict made in the trace: kiln._tracing.make_mapping(cls, keys, *values).
    spec.kind = runtime::OutputSpec::Kind::kConstruct;
    spec.object = Py_BuildValue("(O())", helper("make_mapping"));
    runtime::OutputSpec cls, keys;
    cls.kind = keys.kind = runtime::OutputSpec::Kind::kConstant;
    // A defaultdict: partial(defaultdict, factory), so the rebuilt one keeps its factory.
    static PyObject* partial = detail::lookup_once("functools", "partial");
    cls.object = v->real_type == detail::default_dict_type()
                     ? detail::check(PyObject_CallFunctionObjArgs(partial, (PyObject*)v->real_type,
                                                                  v->value ? v->value : Py_None, nullptr),
                                     "functools.partial(defaultdict, factory)")
                     : Py_NewRef((PyObject*)v->real_type);
    keys.object = PyTuple_New(v->keys.size());
    for (size_t i = 0; i < v->keys.size(); ++i) PyTuple_SET_ITEM(keys.object, i, Py_NewRef(v->keys[i]));
    spec.children.push_back(std::move(cls));
    spec.children.push_back(std::move(keys));
    for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
    return spec;
  }
  spec.kind = runtime::OutputSpec::Kind::kDict;
  spec.object = PyTuple_New(v->keys.size());
  for (size_t i = 0; i < v->keys.size(); ++i) {
    Py_INCREF(v->keys[i]);
    PyTuple_SET_ITEM(spec.object, i, v->keys[i]);
    spec.children.push_back(output_spec(v->items[i], graph_outputs, break_output));
  }
  return spec;
}

runtime::OutputSpec Tracer::output_spec(const VarPtr& v, std::vector<PyObject*>& graph_outputs, bool break_output) {
  runtime::OutputSpec spec;
  if (v->caught) KILN_UNSUPPORTED() << "an exception raised and caught in the traced code leaves it (eager's traceback cannot be rebuilt)";
  if (break_output && is_traced_autocast_exit(v)) {
    // At a break inside an autocast block the trace entered (a manager made in traced code; one from the frame
    // was entered in Python): a new manager like the trace's is entered for real after the graph, and its
    // __exit__ goes on the stack. The block around it (items[1], break_values) is entered first, once.
    if (repeated(v, spec)) return spec;
    spec.kind = runtime::OutputSpec::Kind::kConstruct;
    spec.object = Py_BuildValue("(O())", helper("enter_autocast_like"));
    runtime::OutputSpec manager;
    manager.kind = runtime::OutputSpec::Kind::kConstant;
    manager.object = Py_NewRef(v->items[0]->value);
    spec.children.push_back(std::move(manager));
    if (v->items.size() > 1) spec.children.push_back(output_spec(v->items[1], graph_outputs, break_output));
    return spec;
  }
  // A value that came from the frame (an input tensor, an argument list) is re-read from there: the
  // code after a break must see the very same object, not a copy made by the graph.
  // Containers from the frame are never mutated by the trace (that is refused), so the object itself is
  // returned: eager returns that very list, and code that appended to it meanwhile must see its items.
  if ((break_output && v->source && v->is(VarKind::kTensor)) ||
      (v->source && (v->is(VarKind::kList) || v->is(VarKind::kDict) || v->is(VarKind::kTuple) || v->is(VarKind::kSet))) ||
      (v->by_type && v->source) ||
      // A function read from the frame: a closure is guarded by its code only (another call's equal closure
      // passes), so the object itself is handed on, never the one seen at trace time.
      (v->source && v->is(VarKind::kConst) && PyFunction_Check(v->value))) {
    spec.kind = runtime::OutputSpec::Kind::kSource;
    spec.source = v->source;
    return spec;
  }
  if (break_output && (v->is(VarKind::kList) || v->is(VarKind::kDict) || v->is(VarKind::kObject) ||
                       (v->is(VarKind::kSet) && v->real_type == &PySet_Type))) {
    // A mutable container reachable twice (a local and a call argument) must stay one object.
    if (repeated(v, spec)) return spec;
  }
  switch (v->kind) {
    case VarKind::kTensor:
      spec.kind = runtime::OutputSpec::Kind::kGraphOutput;
      if (break_output) {
        // One graph output per tensor: `y` on the stack and in a local must stay one object.
        for (size_t i = 0; i < graph_outputs.size(); ++i)
          if (graph_outputs[i] == v->value) {
            spec.index = (int)i;
            return spec;
          }
      }
      spec.index = (int)graph_outputs.size();
      graph_outputs.push_back(v->value);
      return spec;
    case VarKind::kSymInt:
      symbolic_->pin(v, break_output ? "alive across a graph break" : "returned");
      [[fallthrough]];
    case VarKind::kConst:
    case VarKind::kModule:
      refuse_escaping_fake(v->value, helper("holds_meta_tensor"));
      spec.kind = runtime::OutputSpec::Kind::kConstant;
      Py_INCREF(v->value);
      spec.object = v->value;
      return spec;
    case VarKind::kObject: {
      spec.kind = runtime::OutputSpec::Kind::kConstruct;
      PyObject* names = PyTuple_New(v->keys.size());
      for (size_t i = 0; i < v->keys.size(); ++i) PyTuple_SET_ITEM(names, i, Py_NewRef(v->keys[i]));
      spec.object = Py_BuildValue("(ON)", (PyObject*)v->real_type, names);
      for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
      return spec;
    }
    case VarKind::kUserObject: {
      // One real object per Var, however many paths reach it (memo slot), on every output.
      if (repeated(v, spec)) return spec;
      spec.kind = runtime::OutputSpec::Kind::kNewObject;
      PyObject* names = PyTuple_New(v->keys.size());
      for (size_t i = 0; i < v->keys.size(); ++i) PyTuple_SET_ITEM(names, i, Py_NewRef(v->keys[i]));
      spec.object = Py_BuildValue("(ON)", (PyObject*)v->real_type, names);
      for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
      return spec;
    }
    case VarKind::kTuple:
      if (v->real_type) {
        spec.kind = runtime::OutputSpec::Kind::kTypedTuple;
        Py_INCREF(v->real_type);
        spec.object = (PyObject*)v->real_type;
        for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
        return spec;
      }
      [[fallthrough]];
    case VarKind::kList:
      if (v->is(VarKind::kList) && v->real_type)
        KILN_UNSUPPORTED() << "returning a " << (is_dict_view(v) ? v->real_type->tp_name : "slice of a ModuleList") << " made in the trace";
      spec.kind = v->is(VarKind::kTuple) ? runtime::OutputSpec::Kind::kTuple : runtime::OutputSpec::Kind::kList;
      for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
      return spec;
    case VarKind::kIterator: {
      // A returned iterator (`return iter(items)`): a new one over the items it has left, on every call. One alive
      // at a graph break is refused (graph_break.cpp), as it may be a for loop's.
      if (break_output) break;
      spec.kind = runtime::OutputSpec::Kind::kConstruct;
      spec.object = Py_BuildValue("(O())", helper("make_iterator"));
      for (size_t i = v->position; i < v->items.size(); ++i)
        spec.children.push_back(output_spec(v->items[i], graph_outputs, break_output));
      return spec;
    }
    case VarKind::kSet: {
      // Built again from its items, in their order (kiln._tracing.make_set: set(items) or frozenset(items)); a set
      // reached twice at a break keeps the memo slot repeated() gave it above.
      spec.kind = runtime::OutputSpec::Kind::kConstruct;
      spec.object = Py_BuildValue("(O())", helper(v->real_type == &PySet_Type ? "make_set" : "make_frozenset"));
      for (const VarPtr& item : v->items) spec.children.push_back(output_spec(item, graph_outputs, break_output));
      return spec;
    }
    case VarKind::kDict: {
      runtime::OutputSpec dict = dict_spec(v, graph_outputs, break_output);
      dict.index = spec.index;  // the memo slot repeated() may have given it
      return dict;
    }
    case VarKind::kMethod:
      if (!break_output) break;
      spec.kind = runtime::OutputSpec::Kind::kBoundMethod;
      Py_INCREF(v->value);
      spec.object = v->value;
      spec.children.push_back(output_spec(v->items[0], graph_outputs, break_output));
      return spec;
    case VarKind::kSlice:
      if (!break_output || !is_constant(v)) break;
      spec.kind = runtime::OutputSpec::Kind::kConstant;
      spec.object = to_python(v);
      return spec;
    default: break;
  }
  KILN_UNSUPPORTED() << (break_output ? "keeping a " : "returning a ") << v->describe()
                     << (break_output ? " alive across a graph break" : "");
}

TraceResult Tracer::finish(const VarPtr& returned, bool break_output) {
  KILN_ASSERT(returned) << "finishing a trace without an output";
  const SymbolicIntsScope symbolic_ints(symbolic_.get());
  TraceResult result;
  std::vector<PyObject*> outputs;
  // With stores to replay, values are rebuilt as at a break (a tensor or list both returned and stored
  // stays one object, as in eager).
  std::unordered_set<const Var*> seen;
  if (!break_output) break_output = !stores_.empty() || reaches_user_object(returned, seen);
  result.output = output_spec(returned, outputs, break_output);
  if (!stores_.empty()) result.output = with_stores(std::move(result.output), outputs);
  PyObject* out_list = PyList_New(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    Py_INCREF(outputs[i]);
    PyList_SET_ITEM(out_list, i, outputs[i]);
  }
  PyObject* graph = PyObject_CallMethod(recorder_, "finish", "O", out_list);
  Py_DECREF(out_list);
  if (!graph) rethrow_python("finishing the graph");
  result.graph = graph;
  if (symbolic_) symbolic_->finish(graph, recorded_size_arguments(recorder_), *guards_, input_sources_);
  PyObject* n = PyObject_GetAttrString(graph, "num_nodes");
  if (n && PyCallable_Check(n)) Py_SETREF(n, PyObject_CallNoArgs(n));
  result.num_ops = n && PyLong_Check(n) ? (int)PyLong_AsLong(n) : 0;
  Py_XDECREF(n);
  PyErr_Clear();
  result.guards = std::move(guards_);
  result.input_sources = std::move(input_sources_);
  Py_INCREF(example_inputs_);
  result.example_inputs = example_inputs_;
  return result;
}

}  // namespace kiln::trace
