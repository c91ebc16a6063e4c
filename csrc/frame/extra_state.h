#pragma once
// Per-code-object cache storage for the frame hook, kept in the code object's co_extra slot.
//
// One heap ExtraState per code object the hook has compiled or marked: its cache entries (most
// recently used first) and the "skip this code" mark. The state lives as long as the code object
// (CPython calls our free function when the code is deallocated); a registry of live states lets
// reset_all() reach every one of them. All of it is touched only with the GIL held.
#include <Python.h>

#include <memory>
#include <vector>

#include "frame/frame.h"

namespace kiln::frame {

/// A cache entry as the hook stores it: the compiler's entry plus the function object the shadow
/// frame runs (built on first use; reused while the original function has no closure).
struct EntrySlot {
  std::unique_ptr<CacheEntry> entry;
  PyObject* shadow_function = nullptr;  ///< strong reference or NULL
  explicit EntrySlot(std::unique_ptr<CacheEntry> e) : entry(std::move(e)) {}
  ~EntrySlot() { Py_XDECREF(shadow_function); }
  EntrySlot(const EntrySlot&) = delete;
  EntrySlot& operator=(const EntrySlot&) = delete;
};

struct ExtraState {
  /// Shared so that a guard or a running entry survives a reset_all() issued while it runs.
  std::vector<std::shared_ptr<EntrySlot>> entries;  ///< most recently used first
  bool skip = false;                                 ///< never intercept this code again
  int8_t resume = -1;  ///< whether the code is a resume function kiln made (-1: not looked at yet)
  /// Bumped whenever `entries` changes, so a walk over them notices reentrant changes.
  unsigned long long version = 0;

  void move_to_front(size_t index);
  void add_front(std::unique_ptr<CacheEntry> entry);
  /// Moves the entries whose guards expired out (callers drop them once they no longer iterate).
  std::vector<std::shared_ptr<EntrySlot>> take_expired_entries();
  /// Moves every entry out (callers drop them once they no longer iterate over states).
  std::vector<std::shared_ptr<EntrySlot>> take_entries();
};

/// The code object's state, or nullptr when the hook never stored one.
ExtraState* extra_state_of(PyCodeObject* code);
/// The code object's state, created on first use; nullptr with a Python error set on failure.
ExtraState* ensure_extra_state(PyCodeObject* code);
/// Clears entries and skip marks of every live state.
void reset_all_extra_states();

}  // namespace kiln::frame
