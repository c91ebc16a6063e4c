#pragma once
// Facts about a code object's localsplus layout that the tracer and the code generators share.
#include <Python.h>

namespace kiln::trace {

// co_localspluskinds bits (CPython's Include/internal/pycore_code.h).
inline constexpr int kFastCell = 0x40;  // CO_FAST_CELL: a cell (an argument captured by a nested function too)
inline constexpr int kFastFree = 0x80;  // CO_FAST_FREE

/// Localsplus slots that hold bound arguments: positional, keyword-only, *args, **kwargs.
inline int argument_slots(PyCodeObject* code) {
  return code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & CO_VARARGS) ? 1 : 0) +
         ((code->co_flags & CO_VARKEYWORDS) ? 1 : 0);
}

}  // namespace kiln::trace
