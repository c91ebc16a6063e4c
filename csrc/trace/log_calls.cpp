// Logging calls in traced code (`logger.warning(...)`, a library's `logger.warning_once(...)`): a log line is a side
// effect the graph cannot hold, and breaking the graph at each one splits models whose loss path warns. The call is
// recorded among the traced assignments (stores.cpp) and made for real by the compiled frame right after its graph,
// in program order, on every call: the logger then decides, as in eager, whether the line appears (its level, its
// handlers, a once-only cache keyed on the message). The arguments are those the trace computed, rebuilt like any
// stored value. Which calls qualify is _tracing.is_log_call's answer: the level methods of a logging.Logger or
// LoggerAdapter, without exc_info/stack_info (they read the stack of the moment), never logger.exception.
// What differs from eager is only where the record says it came from (the compiled frame's line, not the call's).
// warnings.warn(...) is deferred the same way (_tracing.is_deferrable_output_call): a warning's location is then the
// compiled frame's line too, and a warning the filters turn into an error is not deferred (it raises where the traced
// code made it, at a graph break). print stays a graph break.
#include <unordered_set>

#include "common/error.h"
#include "trace/call_helpers.h"
#include "trace/graph_break.h"
#include "trace/tracer.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

VarPtr Tracer::defer_log_call(const VarPtr& fn, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  PyObject* function = nullptr;
  PyObject* self = nullptr;
  if (fn->is(VarKind::kMethod) && fn->items[0]->is(VarKind::kConst)) {
    function = fn->value;
    self = fn->items[0]->value;
  } else if (fn->is(VarKind::kConst) && PyMethod_Check(fn->value)) {
    function = PyMethod_GET_FUNCTION(fn->value);
    self = PyMethod_GET_SELF(fn->value);
  }
  static PyObject* warn = detail::lookup_once("warnings", "warn");
  const bool plain = !function && fn->is(VarKind::kConst) && fn->value == warn;
  if (plain) {
    function = fn->value;  // warnings.warn(...)
    self = Py_None;
  }
  if (!function || !self) return nullptr;
  PyObject* kwnames = PyTuple_New(kwargs.size());
  for (size_t i = 0; i < kwargs.size(); ++i) PyTuple_SET_ITEM(kwnames, i, Py_NewRef(kwargs[i].first));
  PyObject* answer = PyObject_CallFunctionObjArgs(helper(plain ? "is_deferrable_output_call" : "is_log_call"), function,
                                                  self, kwnames, nullptr);
  Py_DECREF(kwnames);
  if (!answer) rethrow_python("classifying a logging call");
  Py_DECREF(answer);
  if (answer != Py_True) return nullptr;

  std::vector<PyObject*> keys;
  std::vector<VarPtr> values;
  for (const auto& [name, value] : kwargs) {
    keys.push_back(Py_NewRef(name));
    values.push_back(value);
  }
  VarPtr call = make_sequence(VarKind::kTuple, {fn, make_sequence(VarKind::kTuple, args),
                                                make_dict(std::move(keys), std::move(values))});
  std::unordered_set<const Var*> seen;
  std::string why = unrebuildable(call, seen);
  if (!why.empty())
    KILN_UNSUPPORTED() << "calling " << calls::name_of(function) << (plain ? "" : " of a logger") << " (an argument is "
                       << why << ": the call cannot be made after the graph)";
  PendingStore store;
  store.owner = Py_NewRef(Py_None);
  store.name = Py_NewRef(Py_None);
  store.value = std::move(call);
  store.call = true;
  stores_.push_back(std::move(store));
  return make_const(Py_None);
}

}  // namespace kiln::trace
