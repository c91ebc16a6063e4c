// Per-version access to CPython's interpreter frames and thread data stack (see cpython_shim.h).
//
// CPython does not export the helpers that push, clear and pop frames on 3.11/3.12, so this file
// carries its own equivalents, written from the layout in Include/internal/pycore_frame.h:
//   push:  bump tstate->datastack_top, or start a new _PyStackChunk from the object arena allocator
//          (the allocator CPython's own pop frees chunks with, so either side may pop our frames);
//   clear: drop the frame's references; a frame object that outlives the frame takes a copy of it
//          (so tracebacks and sys._getframe() results stay valid);
//   pop:   reset datastack_top, or free the chunk the frame started.
// 3.13 exports _PyThreadState_PopFrame and _PyEval_FrameClearAndPop, which are used instead.
#ifndef Py_BUILD_CORE_MODULE
#define Py_BUILD_CORE_MODULE
#endif
#include <Python.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030E0000
#error "kiln's frame hook supports CPython 3.11, 3.12 and 3.13 only: add this version's frame layout to cpython_shim.c"
#endif

#ifdef Py_GIL_DISABLED
#error "kiln's frame hook relies on the GIL; free-threaded CPython builds are not supported"
#endif

#include <string.h>

#include "internal/pycore_frame.h"

#include "frame/cpython_shim.h"

#if PY_VERSION_HEX >= 0x030D0000
#define KILN_PY313 1
#endif
#if PY_VERSION_HEX >= 0x030C0000
#define KILN_PY312_OR_LATER 1
#endif

// --- field access that differs by version ------------------------------------------------------

#ifdef KILN_PY313
static PyObject* frame_code_object(_PyInterpreterFrame* f) { return f->f_executable; }
static PyObject* frame_function(_PyInterpreterFrame* f) { return f->f_funcobj; }
static int frame_not_started(_PyInterpreterFrame* f, PyCodeObject* code) {
  return f->instr_ptr == _PyCode_CODE(code);
}
#elif defined(KILN_PY312_OR_LATER)
static PyObject* frame_code_object(_PyInterpreterFrame* f) { return (PyObject*)f->f_code; }
static PyObject* frame_function(_PyInterpreterFrame* f) { return f->f_funcobj; }
static int frame_not_started(_PyInterpreterFrame* f, PyCodeObject* code) {
  return f->prev_instr == _PyCode_CODE(code) - 1;
}
#else
static PyObject* frame_code_object(_PyInterpreterFrame* f) { return (PyObject*)f->f_code; }
static PyObject* frame_function(_PyInterpreterFrame* f) { return (PyObject*)f->f_func; }
static int frame_not_started(_PyInterpreterFrame* f, PyCodeObject* code) {
  return f->prev_instr == _PyCode_CODE(code) - 1;
}
#endif

/// Words of data stack a frame for `code` occupies (specials + locals + value stack).
static int frame_size_in_words(PyCodeObject* code) {
#ifdef KILN_PY312_OR_LATER
  return code->co_framesize;
#else
  return code->co_nlocalsplus + code->co_stacksize + (int)FRAME_SPECIALS_SIZE;
#endif
}

void kiln_shim_read_frame(struct _PyInterpreterFrame* frame, KilnFrameFacts* out) {
  memset(out, 0, sizeof(*out));
  PyObject* code_object = frame_code_object(frame);
  if (code_object == NULL || !PyCode_Check(code_object)) return;
  PyCodeObject* code = (PyCodeObject*)code_object;
  PyObject* function = frame_function(frame);
  out->code = code;
  out->function = (function != NULL && PyFunction_Check(function)) ? function : NULL;
  out->globals = frame->f_globals;
  out->builtins = frame->f_builtins;
  out->localsplus = frame->localsplus;
  out->nlocalsplus = code->co_nlocalsplus;
  out->owned_by_thread = frame->owner == FRAME_OWNED_BY_THREAD;
  out->not_started = out->owned_by_thread && frame_not_started(frame, code);
  out->has_locals_mapping = frame->f_locals != NULL;
}

int kiln_shim_tracing_active(PyThreadState* tstate) {
  return tstate->tracing > 0 || tstate->c_tracefunc != NULL || tstate->c_profilefunc != NULL;
}

int kiln_shim_argument_slots(PyCodeObject* code) {
  return code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & CO_VARARGS) ? 1 : 0) +
         ((code->co_flags & CO_VARKEYWORDS) ? 1 : 0);
}

// --- data stack: push ------------------------------------------------------------------------

// Any size works: a chunk records its own size and is freed with it. These match CPython's
// choice so chunk churn looks the same as without kiln.
enum { kDataStackChunkBytes = 16 * 1024, kChunkHeadroomWords = 1000 };

static _PyInterpreterFrame* push_frame_memory(PyThreadState* tstate, int words) {
  if (tstate->datastack_top != NULL && words < tstate->datastack_limit - tstate->datastack_top) {
    _PyInterpreterFrame* frame = (_PyInterpreterFrame*)tstate->datastack_top;
    tstate->datastack_top += words;
    return frame;
  }
  size_t bytes = kDataStackChunkBytes;
  while (bytes < sizeof(PyObject*) * (size_t)(words + kChunkHeadroomWords)) bytes *= 2;
  PyObjectArenaAllocator arena;
  PyObject_GetArenaAllocator(&arena);
  _PyStackChunk* chunk = (_PyStackChunk*)arena.alloc(arena.ctx, bytes);
  if (chunk == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  chunk->previous = tstate->datastack_chunk;
  chunk->size = bytes;
  chunk->top = 0;
  if (tstate->datastack_chunk != NULL)
    tstate->datastack_chunk->top = tstate->datastack_top - &tstate->datastack_chunk->data[0];
  tstate->datastack_chunk = chunk;
  tstate->datastack_limit = (PyObject**)((char*)chunk + bytes);
  // A root chunk (no previous) is never popped: CPython starts it one word in so that its first
  // frame is not at data[0]; keep that convention. Here a frame is always running, so the
  // thread has a root chunk already and this frame starts at data[0].
  PyObject** base = &chunk->data[chunk->previous == NULL];
  tstate->datastack_top = base + words;
  return (_PyInterpreterFrame*)base;
}

// --- clear and pop (3.11 and 3.12; 3.13 uses CPython's exported versions) -----------------------

#ifndef KILN_PY313
static void pop_frame_memory(PyThreadState* tstate, _PyInterpreterFrame* frame) {
  PyObject** base = (PyObject**)frame;
  _PyStackChunk* chunk = tstate->datastack_chunk;
  if (base == &chunk->data[0]) {
    _PyStackChunk* previous = chunk->previous;
    tstate->datastack_top = &previous->data[previous->top];
    tstate->datastack_chunk = previous;
    tstate->datastack_limit = (PyObject**)((char*)previous + previous->size);
    PyObjectArenaAllocator arena;
    PyObject_GetArenaAllocator(&arena);
    arena.free(arena.ctx, chunk, chunk->size);
  } else {
    tstate->datastack_top = base;
  }
}

/// The frame object `f` outlives `frame`: move the frame's contents (and its references) into
/// the frame object, link f_back to the caller's frame object and let the GC see it.
static void move_frame_into_frame_object(PyFrameObject* f, _PyInterpreterFrame* frame) {
  // f_back must be read while f still points at the live frame (its `previous` link is valid).
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyFrameObject* back = f->f_back == NULL ? PyFrame_GetBack(f) : NULL;
  if (back == NULL) PyErr_Clear();  // only a MemoryError: then the frame has no f_back
  PyErr_Restore(type, value, traceback);

  Py_ssize_t bytes = (char*)&frame->localsplus[frame->stacktop] - (char*)frame;
  _PyInterpreterFrame* copy = (_PyInterpreterFrame*)f->_f_frame_data;
  memcpy(copy, frame, bytes);
  f->f_frame = copy;
  copy->owner = FRAME_OWNED_BY_FRAME_OBJECT;
  copy->previous = NULL;
  if (_PyFrame_IsIncomplete(copy)) {
    // Died before its first RESUME (an error in the prologue): pretend RESUME ran, as CPython does.
    copy->prev_instr = _PyCode_CODE(copy->f_code) + copy->f_code->_co_firsttraceable;
  }
  if (back != NULL) f->f_back = back;  // owns the reference PyFrame_GetBack returned
  if (!PyObject_GC_IsTracked((PyObject*)f)) PyObject_GC_Track((PyObject*)f);
}

/// Drops every reference a thread-owned frame holds (CPython's _PyFrame_Clear), then pops it.
static void clear_and_pop_frame(PyThreadState* tstate, _PyInterpreterFrame* frame) {
  PyFrameObject* f = frame->frame_obj;
  if (f != NULL) {
    frame->frame_obj = NULL;
    if (Py_REFCNT(f) > 1) {
      move_frame_into_frame_object(f, frame);  // the frame object now owns the references
      Py_DECREF(f);
      pop_frame_memory(tstate, frame);
      return;
    }
    Py_DECREF(f);
  }
  for (int i = 0; i < frame->stacktop; i++) Py_XDECREF(frame->localsplus[i]);
  Py_XDECREF(frame->f_locals);
#ifdef KILN_PY312_OR_LATER
  Py_DECREF(frame->f_funcobj);
#else
  Py_DECREF(frame->f_func);
#endif
  Py_DECREF(frame->f_code);
  pop_frame_memory(tstate, frame);
}
#else
// Exported by 3.13 (Include/internal/pycore_ceval.h, which does not compile outside the core).
PyAPI_FUNC(void) _PyEval_FrameClearAndPop(PyThreadState* tstate, _PyInterpreterFrame* frame);

static void clear_and_pop_frame(PyThreadState* tstate, _PyInterpreterFrame* frame) {
  _PyEval_FrameClearAndPop(tstate, frame);
}
#endif

// --- tracebacks through resume functions ------------------------------------------------------

/// Length of `qualname` up to its first resume marker (the whole length when it has none).
static Py_ssize_t base_qualname_length(const char* qualname, int* has_marker) {
  const char* at = strstr(qualname, KILN_RESUME_QUALNAME_MARKER);
  *has_marker = at != NULL;
  return at ? at - qualname : (Py_ssize_t)strlen(qualname);
}

/// True when `inner` is a resume function kiln made for the same Python function as `outer`.
static int is_resume_of_same_function(PyCodeObject* outer, PyCodeObject* inner) {
  if (outer->co_firstlineno != inner->co_firstlineno) return 0;
  if (PyUnicode_Compare(outer->co_filename, inner->co_filename) != 0) return 0;
  const char* outer_name = PyUnicode_AsUTF8(outer->co_qualname);
  const char* inner_name = PyUnicode_AsUTF8(inner->co_qualname);
  if (outer_name == NULL || inner_name == NULL) {
    PyErr_Clear();
    return 0;
  }
  int outer_marked, inner_marked;
  Py_ssize_t outer_len = base_qualname_length(outer_name, &outer_marked);
  Py_ssize_t inner_len = base_qualname_length(inner_name, &inner_marked);
  return inner_marked && outer_len == inner_len && strncmp(outer_name, inner_name, (size_t)outer_len) == 0;
}

int kiln_shim_is_resume_code(PyCodeObject* code) {
  const char* qualname = PyUnicode_AsUTF8(code->co_qualname);
  if (qualname == NULL) {
    PyErr_Clear();
    return 0;
  }
  return strstr(qualname, KILN_RESUME_QUALNAME_MARKER) != NULL;
}

void kiln_shim_add_recursion_headroom(PyThreadState* tstate, int delta) {
#ifdef KILN_PY312_OR_LATER
  tstate->py_recursion_remaining += delta;
#else
  tstate->recursion_remaining += delta;
#endif
}

/// Resume frames whose function's own frame (the root of the chain: the transformed frame, whose code has no
/// resume marker) was already dropped from a traceback, with the caller they were given then. Such a frame
/// stands for a whole call: a frame above it of the same function (recursion: a resume function that calls the
/// function again) is another call and stays. Recorded per thread in a small ring, borrowed pointers compared
/// with the frame's current caller: an entry that outlived its frame can at worst leave one frame shown.
#define KILN_CLOSED_RING 32
static _Thread_local struct {
  PyFrameObject* frame;
  PyFrameObject* back;
} closed_resume_frames[KILN_CLOSED_RING];
static _Thread_local int closed_resume_next;

static int resume_chain_closed(PyFrameObject* frame) {
  for (int i = 0; i < KILN_CLOSED_RING; i++)
    if (closed_resume_frames[i].frame == frame && closed_resume_frames[i].back == frame->f_back) return 1;
  return 0;
}

static void close_resume_chain(PyFrameObject* frame) {
  closed_resume_frames[closed_resume_next].frame = frame;
  closed_resume_frames[closed_resume_next].back = frame->f_back;
  closed_resume_next = (closed_resume_next + 1) % KILN_CLOSED_RING;
}

/// The traceback with its head dropped when the head is `code`'s frame calling a resume function of the same
/// Python function: in eager there is one frame where kiln has the transformed frame and the resume frame
/// (tracebacks and PEP 626 line numbers then read as eager's). New reference; `tb` is borrowed.
static PyObject* without_resume_caller(PyObject* tb, PyCodeObject* code) {
  if (tb == NULL || !PyTraceBack_Check(tb)) return Py_XNewRef(tb);
  PyTracebackObject* head = (PyTracebackObject*)tb;
  if (head->tb_next == NULL) return Py_NewRef(tb);
  PyCodeObject* head_code = PyFrame_GetCode(head->tb_frame);
  PyCodeObject* next_code = PyFrame_GetCode(head->tb_next->tb_frame);
  PyFrameObject* resume_frame = head->tb_next->tb_frame;
  // Two entries of one frame (an exception caught and raised again in the same resume frame) are both eager's.
  int hide = head_code == code && head->tb_frame != resume_frame && is_resume_of_same_function(code, next_code) &&
             !resume_chain_closed(resume_frame);
  Py_DECREF(head_code);
  Py_DECREF(next_code);
  if (!hide) return Py_NewRef(tb);
  // The resume frame (finished: its frame object owns its data) points back at the hidden frame; it takes that
  // frame's caller instead, so `tb_frame.f_back` also reads as eager's.
  Py_XSETREF(resume_frame->f_back, PyFrame_GetBack(head->tb_frame));
  if (!kiln_shim_is_resume_code(code)) close_resume_chain(resume_frame);  // the function's own frame: the chain's root
  return Py_NewRef((PyObject*)head->tb_next);
}

/// With an exception raised out of a shadow frame running `code`: see without_resume_caller.
static void hide_resume_caller(PyCodeObject* code) {
#ifdef KILN_PY312_OR_LATER
  PyObject* exc = PyErr_GetRaisedException();
  if (exc == NULL) return;
  PyObject* tb = PyException_GetTraceback(exc);
  PyObject* kept = without_resume_caller(tb, code);
  if (kept != tb) PyException_SetTraceback(exc, kept);
  Py_XDECREF(kept);
  Py_XDECREF(tb);
  PyErr_SetRaisedException(exc);
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* kept = without_resume_caller(tb, code);
  if (kept != tb && value != NULL && PyExceptionInstance_Check(value)) PyException_SetTraceback(value, kept);
  Py_XDECREF(tb);
  PyErr_Restore(type, value, kept);
#endif
}

// --- running a shadow frame --------------------------------------------------------------------

/// Fills the specials of a freshly pushed frame; takes a new reference to `function` and its code.
static void initialize_shadow_frame(_PyInterpreterFrame* shadow, _PyInterpreterFrame* original,
                                    PyFunctionObject* function, PyCodeObject* code) {
#ifdef KILN_PY313
  shadow->f_executable = Py_NewRef(code);
  shadow->f_funcobj = Py_NewRef(function);
  shadow->instr_ptr = _PyCode_CODE(code);
  shadow->return_offset = 0;
#elif defined(KILN_PY312_OR_LATER)
  shadow->f_code = (PyCodeObject*)Py_NewRef(code);
  shadow->f_funcobj = Py_NewRef(function);
  shadow->prev_instr = _PyCode_CODE(code) - 1;
  shadow->return_offset = 0;
#else
  shadow->f_code = (PyCodeObject*)Py_NewRef(code);
  shadow->f_func = (PyFunctionObject*)Py_NewRef(function);
  shadow->prev_instr = _PyCode_CODE(code) - 1;
  shadow->is_entry = 0;
#endif
  // The evaluator links `previous` when it starts the frame.
  shadow->previous = NULL;
  shadow->f_globals = original->f_globals;
  shadow->f_builtins = original->f_builtins;
  shadow->f_locals = NULL;
  shadow->frame_obj = NULL;
  shadow->stacktop = code->co_nlocalsplus;
  shadow->owner = FRAME_OWNED_BY_THREAD;
}

PyObject* kiln_shim_run_shadow_frame(PyThreadState* tstate, struct _PyInterpreterFrame* original,
                                     PyObject* shadow_function) {
  PyFunctionObject* function = (PyFunctionObject*)shadow_function;
  PyCodeObject* code = (PyCodeObject*)function->func_code;
  PyCodeObject* original_code = (PyCodeObject*)frame_code_object(original);

  _PyInterpreterFrame* shadow = push_frame_memory(tstate, frame_size_in_words(code));
  if (shadow == NULL) {
    kiln_shim_release_unrun_frame(tstate, original);
    return NULL;
  }
  initialize_shadow_frame(shadow, original, function, code);
  int locals = code->co_nlocalsplus;
  for (int i = 0; i < locals; i++) shadow->localsplus[i] = NULL;
  // Arguments keep their slots (an argument that is also a cell still holds its raw value: the
  // shadow code's MAKE_CELL wraps it). Free variables sit at the end of both layouts; on a fresh
  // frame they are still NULL and the shadow code's COPY_FREE_VARS fills them from the closure.
  int arguments = kiln_shim_argument_slots(original_code);
  for (int i = 0; i < arguments; i++) shadow->localsplus[i] = Py_XNewRef(original->localsplus[i]);
  int free_vars = original_code->co_nfreevars;
  for (int k = 1; k <= free_vars; k++)
    shadow->localsplus[locals - k] = Py_XNewRef(original->localsplus[original_code->co_nlocalsplus - k]);

  PyObject* result = _PyEval_EvalFrameDefault(tstate, shadow, 0);
  if (result == NULL) hide_resume_caller(code);
#ifdef KILN_PY312_OR_LATER
  // The evaluator cleared and popped the shadow frame; the original is now on top of the stack.
  kiln_shim_release_unrun_frame(tstate, original);
#else
  // 3.11: the evaluator leaves its entry frame to the caller; the original's caller clears it.
  clear_and_pop_frame(tstate, shadow);
#endif
  return result;
}

void kiln_shim_release_unrun_frame(PyThreadState* tstate, struct _PyInterpreterFrame* frame) {
#ifdef KILN_PY312_OR_LATER
  // Never linked into the frame chain, so `previous` was never set: make it a clean NULL.
  frame->previous = NULL;
  clear_and_pop_frame(tstate, frame);
#else
  (void)tstate;
  (void)frame;
#endif
}
