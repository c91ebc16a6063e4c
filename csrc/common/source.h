#pragma once
// A Source says how to reach a value from a frame: `x`, `self.layer1.weight`, `G['torch'].float32`.
// The tracer attaches one to every value it reads from outside the traced code; guards/ checks the
// values reached through sources, and runtime/ fetches graph inputs through them on every call.
// Sources are immutable and shared (a child holds its base).
#include <Python.h>

#include <memory>
#include <string>

namespace kiln {

/// The roots a source path starts from. For an intercepted frame, `local(i)` reads localsplus
/// (arguments are bound, cells of arguments still hold raw values); for a compiled call, the
/// transformed code passes the argument values and free-variable values explicitly.
struct SourceRoots {
  PyObject* const* locals = nullptr;  ///< indexed by localsplus index; only arguments are read
  int nlocals = 0;
  PyObject* const* freevars = nullptr;  ///< contents of the free variables (already out of their cells)
  int nfreevars = 0;
  PyObject* closure = nullptr;  ///< alternatively: the function's closure tuple of cells (freevars == nullptr)
  PyObject* globals = nullptr;
  PyObject* builtins = nullptr;
};

enum class SourceKind : unsigned char {
  kLocal,        ///< localsplus[index], named `name`
  kFree,         ///< free variable `index` (0-based among co_freevars)
  kGlobal,       ///< globals[name]
  kBuiltin,      ///< builtins[name]
  kAttr,         ///< getattr(base, name), the generic path
  kInstanceDict, ///< base.__dict__[name]: plain instance attributes (no descriptor ran)
  kModuleSlot,   ///< base.__dict__[<dict_name>][name]: nn.Module _parameters/_buffers/_modules
  kIndex,        ///< base[index] for tuples and lists
  kDictKey,      ///< base[key] for dicts with constant string keys (key in `name`)
  kObject,       ///< a fixed object held by the source (another module's globals dict, a closure cell)
  kType,         ///< type(base)
};

class Source;
using SourcePtr = std::shared_ptr<const Source>;

class Source {
 public:
  static SourcePtr local(int index, std::string name);
  static SourcePtr free(int index, std::string name);
  static SourcePtr global(std::string name);
  static SourcePtr builtin(std::string name);
  static SourcePtr attr(SourcePtr base, std::string name);
  static SourcePtr instance_dict(SourcePtr base, std::string name);
  /// `slot` is "_parameters", "_buffers" or "_modules".
  static SourcePtr module_slot(SourcePtr base, std::string slot, std::string name);
  static SourcePtr index(SourcePtr base, long long i);
  static SourcePtr dict_key(SourcePtr base, std::string key);
  /// type(base): the class of the value `base` reaches (its attributes are guarded through this).
  static SourcePtr type_of(SourcePtr base);
  /// A root that is `object` itself (kept alive by the source); `label` is for describe().
  static SourcePtr object(PyObject* object, std::string label);

  SourceKind kind() const { return kind_; }
  const std::string& name() const { return name_; }
  long long index() const { return index_; }
  const SourcePtr& base() const { return base_; }
  /// Interned attribute/key/slot names (kept alive with the source) for fast lookups.
  PyObject* py_name() const { return py_name_; }
  PyObject* py_slot() const { return py_slot_; }

  /// Readable, Python-like: `self.layer1.weight`, `G['scale']`, `args[0]`.
  std::string describe() const;
  /// New reference, or NULL with a Python error set when the path no longer exists.
  PyObject* resolve(const SourceRoots& roots) const;
  /// One step from an already resolved base value (new reference or NULL + error).
  PyObject* resolve_from(PyObject* base_value, const SourceRoots& roots) const;

  ~Source();
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

 private:
  Source(SourceKind kind, SourcePtr base, std::string name, long long index, std::string slot = {});
  SourceKind kind_;
  SourcePtr base_;
  std::string name_;
  std::string slot_;
  long long index_ = 0;
  int depth_ = 0;  ///< steps from the root
  PyObject* py_name_ = nullptr;
  PyObject* py_slot_ = nullptr;
  PyObject* object_ = nullptr;
};

}  // namespace kiln
