#pragma once
// The frame hook's window onto CPython's private frame layout (3.11, 3.12, 3.13).
//
// Everything that touches _PyInterpreterFrame's fields or the thread's data stack lives in
// cpython_shim.c: CPython's internal headers (pycore_frame.h and what it pulls in) are C, not
// always valid C++, and their layout changes per minor version. C++ code sees only these functions
// and treats the frame as an opaque pointer.
#include <Python.h>

#ifdef __cplusplus
extern "C" {
#endif

struct _PyInterpreterFrame;

/// What a resume function's qualname adds to its function's ("f.<resume at line 12>", trace/break_code.cpp):
/// tracebacks through resume functions are recognised by it.
#define KILN_RESUME_QUALNAME_MARKER ".<resume at line "

/// True when `code` is a resume function kiln made (its qualname holds KILN_RESUME_QUALNAME_MARKER).
int kiln_shim_is_resume_code(PyCodeObject* code);

/// Adds `delta` to the thread's Python recursion headroom (3.11: recursion_remaining, 3.12+:
/// py_recursion_remaining). A resume function's frame continues its caller's function, which eager runs in one
/// frame: the hook gives it one level of headroom while it runs, so that recursion limits read as eager's.
void kiln_shim_add_recursion_headroom(PyThreadState* tstate, int delta);

/// What the hook needs to know about a frame it receives (all pointers borrowed).
typedef struct KilnFrameFacts {
  PyCodeObject* code;      // NULL when the frame does not run a code object (3.13 trampolines)
  PyObject* function;      // the function object, or NULL when the frame has none
  PyObject* globals;
  PyObject* builtins;
  PyObject* const* localsplus;
  int nlocalsplus;
  int not_started;         // no instruction has run yet (a fresh call)
  int owned_by_thread;     // 0 for generator- or frame-object-owned frames
  int has_locals_mapping;  // module and class bodies run with an f_locals mapping
} KilnFrameFacts;

void kiln_shim_read_frame(struct _PyInterpreterFrame* frame, KilnFrameFacts* out);

/// True while sys.settrace/sys.setprofile is active on the thread or a trace function runs.
int kiln_shim_tracing_active(PyThreadState* tstate);

/// Runs `shadow_function`'s code in place of `original`: pushes a shadow frame, moves the
/// arguments and free variables over (new references), evaluates it with the default evaluator and
/// leaves the data stack exactly as the default evaluation of `original` would have (3.11: the
/// caller still clears `original`; 3.12+: `original` is cleared and popped here).
/// The shadow code must bind the same arguments and free variables as the original code.
PyObject* kiln_shim_run_shadow_frame(PyThreadState* tstate, struct _PyInterpreterFrame* original,
                                     PyObject* shadow_function);

/// Gives up on a frame without running it (the hook returns NULL with an exception set):
/// 3.11 leaves it to the caller, 3.12+ clear and pop it here because the evaluator owns it.
void kiln_shim_release_unrun_frame(PyThreadState* tstate, struct _PyInterpreterFrame* frame);

/// Number of localsplus slots that hold bound arguments (positional, keyword-only, *args, **kw).
int kiln_shim_argument_slots(PyCodeObject* code);

#ifdef __cplusplus
}
#endif
