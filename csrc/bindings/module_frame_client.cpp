// kiln._C's side of the frame hook: forwards frame/frame.h's functions to kiln._core, which owns the
// one hook of the process (its state would otherwise exist once per extension module).
#include "common/error.h"
#include "frame/frame.h"

namespace kiln::frame {

namespace {
const FrameApi& api() {
  static const FrameApi* table = [] {
    // Import the submodule itself: PyCapsule_Import walks attributes, which a package still being
    // initialised does not have yet.
    PyObject* core = PyImport_ImportModule("kiln._core");
    PyObject* capsule = core ? PyObject_GetAttrString(core, "frame_api") : nullptr;
    auto* t = capsule ? static_cast<const FrameApi*>(PyCapsule_GetPointer(capsule, "kiln._core.frame_api")) : nullptr;
    Py_XDECREF(capsule);
    Py_XDECREF(core);
    if (!t) PyErr_Clear();
    return t;
  }();
  KILN_ASSERT(table) << "kiln._core (the frame hook) could not be imported";
  KILN_ASSERT_EQ(table->version, kFrameApiVersion) << "kiln._core and kiln._C come from different builds";
  return *table;
}
}  // namespace

Compiler* set_thread_compiler(Compiler* compiler) { return api().set_thread_compiler(compiler); }
Compiler* thread_compiler() { return api().thread_compiler(); }
bool hook_installed() { return api().hook_installed(); }
std::vector<const CacheEntry*> entries_of(PyCodeObject* code) { return api().entries_of(code); }
bool is_skipped(PyCodeObject* code) { return api().is_skipped(code); }
void reset_all() { api().reset_all(); }
Counters counters() { return api().counters(); }

}  // namespace kiln::frame
