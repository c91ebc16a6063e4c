#pragma once
// A Source says how to reach a value from a frame: `x`, `self.layer1.weight`, `G['torch'].float32`.
// The tracer attaches one to every value it reads from outside the traced code; guards/ checks the
// values reached through sources, and runtime/ fetches graph inputs through them on every call.
// Sources are immutable and shared (a child holds its base).
#include <Python.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

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
  kDictKey,      ///< base[key] for dicts with constant keys (str, int or None: the key object in py_name)
  kObject,       ///< a fixed object held by the source (another module's globals dict, a closure cell)
  kType,         ///< type(base)
  kMappingGet,   ///< base.get(name): a mapping's item or None (os.environ, whose reads run Python)
  kCall,         ///< base(): the answer of a query of process state that takes no arguments
  kCallRaises,   ///< the class of the exception base() raises, or None when it returns
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
  /// base[key] for a dict key is_plain_key accepts: `key` is kept by the source.
  static SourcePtr dict_item(SourcePtr base, PyObject* key);
  /// The keys dict_item takes: str, int (bool included), None, and keys compared by identity (classes; objects
  /// without an instance dict that keep object's hash and equality, such as typing.Union).
  static bool is_plain_key(PyObject* key);
  /// type(base): the class of the value `base` reaches (its attributes are guarded through this).
  static SourcePtr type_of(SourcePtr base);
  /// base.get(key), None when the key is absent: read again on every check (no snapshot covers it).
  static SourcePtr mapping_get(SourcePtr base, std::string key);
  /// base() (a query of process state, `torch.cuda.is_current_stream_capturing`): called again on every check.
  static SourcePtr call(SourcePtr base);
  /// type(the exception base() raises), or None when base() returns: a query that raised at trace time (on a
  /// build without CUDA, torch.cuda.is_current_stream_capturing raises) is guarded to raise the same again.
  static SourcePtr call_raises(SourcePtr base);
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
  /// The same last step as `other` (kind, index, interned name and slot, object): two sources whose steps
  /// are the same from their roots reach the same value. The tracer makes a new source at each access, so
  /// equal paths are seldom the same objects.
  bool same_step(const Source& other) const {
    return kind_ == other.kind_ && index_ == other.index_ && py_name_ == other.py_name_ && py_slot_ == other.py_slot_ &&
           object_ == other.object_;
  }

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

/// Resolves many sources one after the other, keeping the values of the bases the last one went through: a
/// model's parameters share their paths (`self._modules['layer1']._modules['0']...`), so each source costs
/// only the steps below the prefix it shares with the one before (resnet50's 320 graph inputs: six steps
/// each, one or two with the walker). The values are read once per walker, at the time of the first source
/// that needs them; a walker lives for one call.
class SourceWalker {
 public:
  explicit SourceWalker(const SourceRoots& roots) : roots_(roots) {}
  ~SourceWalker();
  SourceWalker(const SourceWalker&) = delete;
  SourceWalker& operator=(const SourceWalker&) = delete;
  /// New reference, or NULL with a Python error set (as Source::resolve).
  PyObject* resolve(const Source& source);

 private:
  void truncate(size_t n);
  const SourceRoots& roots_;
  std::vector<std::pair<const Source*, PyObject*>> path_;  ///< root first; owned references (steps compared by same_step)
  std::vector<const Source*> chain_;                       ///< scratch: the source's path, leaf first
};

}  // namespace kiln
