#pragma once
// Python exceptions raised at trace time by code the tracer runs as eager would (a query of process state, a
// builtin on constants, a `raise` statement), so that the traced code's own `try`/`except` can catch them.
#include <Python.h>

#include <string>

#include "trace/variables.h"

namespace kiln::trace {

/// Thrown where eager would raise `exception`. The interpreter sends it to the raising instruction's
/// exception-table handler in the same frame (InstructionTranslator::run); without one the raise becomes a graph
/// break at the root frame's instruction that led there, and eager code raises it for real.
class TracedRaise {
 public:
  /// `exception`: a Var whose value is an exception instance (exception_var's, or a kObject built in the trace).
  TracedRaise(VarPtr exception, std::string context);
  const VarPtr& exception() const { return exception_; }
  /// "asking f(): RuntimeError: message".
  std::string describe() const;

 private:
  VarPtr exception_;
  std::string context_;
};

/// True when instances of the exception class `cls` are plain data: it keeps the built-in __new__ and __init__,
/// so `cls(*args)` on constants runs no Python code and makes an equal exception again.
bool plain_exception_class(PyObject* cls);
/// The Var of an exception instance: a record rebuilt by calling its class again on its args wherever it leaves the
/// trace (a fresh exception per call, as eager raises, never one object shared by every call), or a constant for
/// other classes. Steals nothing.
VarPtr exception_var(PyObject* instance);

/// Throws the pending Python error as a TracedRaise (`context` says what raised it).
[[noreturn]] void raise_pending(const std::string& context);

}  // namespace kiln::trace
