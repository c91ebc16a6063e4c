// Object identity and deep copies in traced code: `id(x)` and `copy.deepcopy(x)`.
//
// id() of a value read from the frame pins it by identity (an identity guard), so its id is a constant of the trace;
// an object made in the trace has no identity until it exists for real, so id() of one stays a graph break.
//
// copy.deepcopy is not inlined (its default protocol ends in object.__reduce_ex__, C code the trace cannot follow);
// its effect is rebuilt on Vars instead, with one memo per call as deepcopy keeps: tuples, lists and dicts become new
// containers of copies (made in the trace, so later changes are the trace's own), values deepcopy returns unchanged
// (numbers, strings, classes, functions, dtypes) stay, and a plain object (one made in the trace, or one read from the
// frame whose class copies by the default protocol: kiln._tracing.deepcopy_refusal) becomes a new kUserObject of its
// class whose attribute table holds copies of its __dict__'s items, read from the frame with their guards. The copy
// is made for real only if it leaves the trace (OutputSpec::kNewObject), as deepcopy's _reconstruct makes it: the
// class's __new__ and a __dict__ update, no __init__. Tensors, modules and anything else stay graph breaks.
#include <unordered_map>

#include "common/error.h"
#include "trace/call_helpers.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

PyObject* copy_module_function(const char* name) {
  PyObject* module = PyImport_ImportModule("copy");
  PyObject* f = module ? PyObject_GetAttrString(module, name) : nullptr;
  Py_XDECREF(module);
  if (!f) PyErr_Clear();
  return f;  // kept for the process (one reference)
}

}  // namespace

VarPtr Tracer::deep_copy(const VarPtr& v, std::unordered_map<const Var*, VarPtr>& memo) {
  if (auto it = memo.find(v.get()); it != memo.end()) return it->second;
  auto remember = [&](VarPtr copy) {
    memo.emplace(v.get(), copy);
    return copy;
  };
  switch (v->kind) {
    case VarKind::kTuple: {
      if (v->real_type) break;  // a namedtuple: its reducer rebuilds it through its class
      std::vector<VarPtr> items;
      for (const VarPtr& item : v->items) items.push_back(deep_copy(item, memo));
      return remember(make_sequence(VarKind::kTuple, std::move(items)));
    }
    case VarKind::kList: {
      if (v->real_type) break;
      VarPtr copy = remember(make_sequence(VarKind::kList, {}));  // first: an item may refer back to the list
      for (const VarPtr& item : v->items) copy->items.push_back(deep_copy(item, memo));
      return copy;
    }
    case VarKind::kDict: {
      VarPtr copy = remember(make_dict({}, {}));
      for (size_t i = 0; i < v->keys.size(); ++i) {
        copy->keys.push_back(Py_NewRef(v->keys[i]));  // keys are constants deepcopy returns unchanged (str, int, None)
        copy->items.push_back(deep_copy(v->items[i], memo));
      }
      return copy;
    }
    case VarKind::kUserObject: {
      PyObject* standin = user_object_standin(v);
      PyObject* refusal = PyObject_CallOneArg(helper("deepcopy_refusal"), standin);
      Py_DECREF(standin);
      if (!refusal) rethrow_python("classifying an object to copy");
      if (refusal != Py_None) {
        std::string why = PyUnicode_Check(refusal) ? PyUnicode_AsUTF8(refusal) : "?";
        Py_DECREF(refusal);
        KILN_UNSUPPORTED() << "copy.deepcopy of a " << v->describe() << " (" << why << ")";
      }
      Py_DECREF(refusal);
      VarPtr copy = remember(make_user_object(v->real_type, v->class_source));
      for (size_t i = 0; i < v->keys.size(); ++i) {
        copy->keys.push_back(Py_NewRef(v->keys[i]));
        copy->items.push_back(deep_copy(v->items[i], memo));
      }
      return copy;
    }
    case VarKind::kConst: {
      if (!v->by_type) {  // pinned by identity or by value: a value deepcopy may return as it is
        PyObject* same = PyObject_CallOneArg(helper("deepcopy_is_identity"), v->value);
        if (!same) rethrow_python("copy.deepcopy");
        Py_DECREF(same);
        if (same == Py_True) return remember(v);
      }
      if (!v->source || PyType_Check(v->value) || PyModule_Check(v->value)) break;
      // A plain object from the frame: its class copies by the default protocol, its state is its __dict__.
      PyObject* refusal = PyObject_CallOneArg(helper("deepcopy_refusal"), v->value);
      if (!refusal) rethrow_python("classifying an object to copy");
      if (refusal != Py_None) {
        std::string why = PyUnicode_Check(refusal) ? PyUnicode_AsUTF8(refusal) : "?";
        Py_DECREF(refusal);
        KILN_UNSUPPORTED() << "copy.deepcopy of a " << Py_TYPE(v->value)->tp_name << " (" << why << ")";
      }
      Py_DECREF(refusal);
      guards_->add_type(v->source, Py_TYPE(v->value));
      PyObject* dict = PyObject_GenericGetDict(v->value, nullptr);
      if (!dict) rethrow_python("the __dict__ of an object to copy");
      VarPtr state = wrap(dict, Source::attr(v->source, "__dict__"));
      Py_DECREF(dict);
      if (!state->is(VarKind::kDict))
        KILN_UNSUPPORTED() << "copy.deepcopy of a " << Py_TYPE(v->value)->tp_name << " whose __dict__ has keys other than strings";
      VarPtr copy = remember(make_user_object(Py_TYPE(v->value), Source::type_of(v->source)));
      for (size_t i = 0; i < state->keys.size(); ++i) {
        copy->keys.push_back(Py_NewRef(state->keys[i]));
        copy->items.push_back(deep_copy(state->items[i], memo));
      }
      return copy;
    }
    default: break;
  }
  KILN_UNSUPPORTED() << "copy.deepcopy of a " << v->describe() << " (only constants, containers and plain objects are "
                     << "copied in the graph)";
}

VarPtr Tracer::call_identity_or_copy(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  static PyObject* deepcopy = copy_module_function("deepcopy");
  if (args.size() != 1 || !kwargs.empty()) return nullptr;
  const VarPtr& x = args[0];
  if (f == calls::builtin("id")) {
    if (!x->source || !x->value || !(x->is(VarKind::kConst) || x->is(VarKind::kModule)))
      KILN_UNSUPPORTED() << "id() of a " << x->describe()
                         << " (only objects read from outside the traced code have an identity known to the trace)";
    guards_->add_id(x->source, x->value);  // the same object on every call, so the same id
    x->by_type = false;
    return make_const_steal(PyLong_FromVoidPtr(x->value));
  }
  if (deepcopy && f == deepcopy) {
    std::unordered_map<const Var*, VarPtr> memo;
    return deep_copy(x, memo);
  }
  return nullptr;
}

}  // namespace kiln::trace
