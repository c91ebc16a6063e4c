#include "frame/extra_state.h"

#include <algorithm>
#include <utility>
#include <unordered_set>

namespace kiln::frame {
namespace {

// Leaked on purpose: code objects are freed during interpreter finalization, after C++ static
// destructors might already have run in some embeddings; a heap registry is never torn down.
std::unordered_set<ExtraState*>& live_states() {
  static auto* states = new std::unordered_set<ExtraState*>();
  return *states;
}

// Called by CPython when a code object is deallocated (for every slot, NULL included) and when a
// slot is overwritten; we never overwrite a non-NULL slot.
void free_extra_state(void* pointer) {
  auto* state = static_cast<ExtraState*>(pointer);
  if (state == nullptr) return;
  live_states().erase(state);
  // Deleting drops entries, which may free other code objects and re-enter this function:
  // the registry no longer holds `state`, so that is safe.
  delete state;
}

/// The co_extra index, requested from the interpreter once (indices are never given back).
Py_ssize_t extra_index() {
  static Py_ssize_t index = -1;
  if (index < 0) {
#if PY_VERSION_HEX >= 0x030C0000
    index = PyUnstable_Eval_RequestCodeExtraIndex(free_extra_state);
#else
    index = _PyEval_RequestCodeExtraIndex(free_extra_state);
#endif
  }
  return index;
}

int get_extra(PyCodeObject* code, void** out) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyUnstable_Code_GetExtra(reinterpret_cast<PyObject*>(code), extra_index(), out);
#else
  return _PyCode_GetExtra(reinterpret_cast<PyObject*>(code), extra_index(), out);
#endif
}

int set_extra(PyCodeObject* code, void* value) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyUnstable_Code_SetExtra(reinterpret_cast<PyObject*>(code), extra_index(), value);
#else
  return _PyCode_SetExtra(reinterpret_cast<PyObject*>(code), extra_index(), value);
#endif
}

}  // namespace

void ExtraState::move_to_front(size_t index) {
  if (index == 0) return;
  std::rotate(entries.begin(), entries.begin() + index, entries.begin() + index + 1);
  ++version;
}

void ExtraState::add_front(std::unique_ptr<CacheEntry> entry) {
  entries.insert(entries.begin(), std::make_shared<EntrySlot>(std::move(entry)));
  ++version;
}

std::vector<std::shared_ptr<EntrySlot>> ExtraState::take_expired_entries() {
  std::vector<std::shared_ptr<EntrySlot>> expired;
  for (size_t i = 0; i < entries.size();) {
    const GuardCheck* guard = entries[i]->entry->guard.get();
    if (guard != nullptr && guard->expired()) {
      expired.push_back(std::move(entries[i]));
      entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  if (!expired.empty()) ++version;
  return expired;
}

std::vector<std::shared_ptr<EntrySlot>> ExtraState::take_entries() {
  ++version;
  return std::exchange(entries, {});
}

ExtraState* extra_state_of(PyCodeObject* code) {
  if (extra_index() < 0) return nullptr;
  void* value = nullptr;
  if (get_extra(code, &value) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  return static_cast<ExtraState*>(value);
}

ExtraState* ensure_extra_state(PyCodeObject* code) {
  if (extra_index() < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "kiln: no free co_extra index left");
    return nullptr;
  }
  if (ExtraState* existing = extra_state_of(code)) return existing;
  auto* state = new ExtraState();
  if (set_extra(code, state) < 0) {
    delete state;
    return nullptr;
  }
  live_states().insert(state);
  return state;
}

void reset_all_extra_states() {
  // Collect first, drop after: dropping entries can free code objects, which edits the registry.
  std::vector<std::shared_ptr<EntrySlot>> dropped;
  for (ExtraState* state : live_states()) {
    state->skip = false;
    for (auto& slot : state->take_entries()) dropped.push_back(std::move(slot));
  }
  dropped.clear();
}

}  // namespace kiln::frame
