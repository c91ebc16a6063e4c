#pragma once
// Guards: the conditions under which a traced frame's compiled code may run again.
//
// The tracer records, for each value it read from outside the traced code, a Source and what it
// assumed of the value (its type, identity, constant value, tensor meta, container length).
// GuardTree groups those checks by source path, so each path is resolved once per check even when
// many checks hang below it (`self` -> `self.layer1` -> `self.layer1._parameters['weight']`).
// Checks run in C++ with no Python calls except attribute reads the source path requires.
#include <Python.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/source.h"
#include "graph/shape_rules.h"
#include "graph/sym_expr.h"

namespace kiln::guards {

/// What a tensor guard compares (c10 codes for dtype and device type).
struct TensorSpec {
  PyTypeObject* type = nullptr;  ///< exact Python type (Tensor vs Parameter vs a subclass)
  int dtype = -1;
  int device_type = -1;
  int device_index = -1;
  std::vector<long long> sizes, strides;
  bool requires_grad = false;
  /// Dims whose size may vary (dynamic shapes): empty, or one flag per dim. A dynamic dim matches any size of 2 or
  /// more (0 and 1 change what broadcasting and empty tensors do: those stay specialised); `sizes` keeps the traced
  /// one for messages. With a dynamic dim, strides are checked as a dense layout in `dense_order` (dims innermost
  /// first, as the symbolic strides were made), or compared exactly when the traced strides were not dense.
  std::vector<bool> dynamic;
  std::vector<int> dense_order;
};

/// Relations between the sizes of guarded tensors (dynamic shapes): each size symbol is read from a dim of the
/// tensor some source reaches, and every relation must hold of the values read. The graph compiled for the
/// symbols relies on exactly these (graph/symbolic_sizes.h: its assumptions and specialisations).
struct SizeGuard {
  struct Symbol {
    SourcePtr source;
    int dim = 0;
    graph::sym::Expr symbol;
  };
  std::vector<Symbol> symbols;
  std::vector<graph::shape::Assumption> relations;
};

enum class CheckKind : unsigned char {
  kType,       ///< type(v) is `type`
  kId,         ///< v is `object`
  kConstant,   ///< type(v) is type(object) and v == object (ints, floats, strings, None, bools, tuples of them)
  kTensor,     ///< a tensor matching `tensor`
  kLength,     ///< len(v) == length (tuples, lists, dicts)
  kDictKeys,   ///< list(v.keys()) == `object` (a tuple of keys, in order)
  kHasNoAttr,  ///< v has no attribute/dict entry `name` (a module attribute that must stay absent)
  kNoModuleHooks,  ///< v.__dict__'s `_forward_hooks`, `_forward_pre_hooks` and `_backward_hooks` are empty dicts
  kDictConstants,  ///< v.__dict__[name] == value for each (name, value) pair of `object` (a tuple of pairs)
};

struct Check {
  CheckKind kind;
  /// The expected identity/value/keys (kType: the type). Owned, except where `weak` is set: then only an
  /// address, and `weak` says whether it is still alive.
  PyObject* object = nullptr;
  /// kId and kType on objects that take weak references: a cache entry must not keep a model, its
  /// submodules or a class alive, and an object freed (whose address a new one may take) fails for good.
  PyObject* weak = nullptr;
  long long length = 0;
  std::string name;  ///< kHasNoAttr: the attribute; kId/kType: the type's name, for messages
  TensorSpec tensor;
};

/// Global interpreter/torch state that changes what a graph computes.
struct GlobalState {
  bool grad_enabled = true;
  bool inference_mode = false;
  int default_dtype = 6;  // c10::ScalarType::Float
  /// Devices whose autocast is on (bit 0 CPU, bit 1 CUDA), and the dtype each casts to (c10 codes, -1 when
  /// off). A trace under autocast records its casts (kiln/_fake.py): the graph is only right for this state.
  int autocast = 0;
  int autocast_dtype_cpu = -1;
  int autocast_dtype_cuda = -1;
  /// A torch.func transform (vmap, grad, jacrev) is running: its tensors are functorch wrappers, which
  /// compiled graphs do not take. Frames called there run eagerly.
  bool functorch = false;
  static GlobalState current();
  bool operator==(const GlobalState& o) const {
    return grad_enabled == o.grad_enabled && inference_mode == o.inference_mode && default_dtype == o.default_dtype &&
           autocast == o.autocast && autocast_dtype_cpu == o.autocast_dtype_cpu &&
           autocast_dtype_cuda == o.autocast_dtype_cuda && functorch == o.functorch;
  }
  std::string describe() const;
};

class GuardTree {
 public:
  GuardTree();
  ~GuardTree();
  GuardTree(const GuardTree&) = delete;
  GuardTree& operator=(const GuardTree&) = delete;

  // Building (by the tracer). Duplicate checks on the same path are dropped.
  void add_type(const SourcePtr& s, PyTypeObject* type);
  void add_id(const SourcePtr& s, PyObject* object);
  void add_constant(const SourcePtr& s, PyObject* value);
  void add_tensor(const SourcePtr& s, PyObject* tensor);
  /// Makes `dims` of the tensor check at `s` (add_tensor) dynamic: any size >= 2, strides dense as traced.
  void set_dynamic_dims(const SourcePtr& s, const std::vector<int64_t>& dims);
  /// The relations between sizes the graph relies on (checked after every other check).
  void set_size_guard(SizeGuard guard) { size_guard_ = std::move(guard); }
  const SizeGuard& size_guard() const { return size_guard_; }
  void add_length(const SourcePtr& s, long long length);
  void add_dict_keys(const SourcePtr& s, PyObject* keys_tuple);
  /// The value at `s` must still lack attribute `name` (hasattr() answered False at trace time).
  void add_has_no_attr(const SourcePtr& s, const std::string& name);
  /// The module `s` reaches has no forward, forward-pre or backward hooks: one check reading its __dict__
  /// once, where three length checks walked a node each (a ViT's 263 modules made 789 of its 1821 checks).
  void add_no_module_hooks(const SourcePtr& s);
  /// Each (interned name, value) pair of `pairs` (a tuple, taken over) must stay in the __dict__ of the object
  /// `s` reaches, equal as for add_constant: a built-in module's plain attributes (in_features, eps, training)
  /// in one check that reads the __dict__ once, where each was a node of its own.
  void add_dict_constants(const SourcePtr& s, PyObject* pairs);
  void add_globals_identity(PyObject* globals);
  /// `a` and `b` must lead to the same object (one tensor reached through two paths).
  void add_same_object(const SourcePtr& a, const SourcePtr& b);
  void set_global_state(GlobalState state) { state_ = state; }
  /// Passes whatever the global state (grad mode, autocast...): an entry that runs the frame eagerly for every
  /// input. Without it a tree checks the state it was given, or the default one (grad enabled).
  void accept_any_global_state() { any_global_state_ = true; }
  /// The traced frame's `self`, an nn.Module pinned by identity at `s` (a root source). Its identity check
  /// runs first, so another instance of the same module class fails after one pointer compare; and the
  /// compiler counts entries per instance (compile_frame.cpp: kiln.config.module_instance_limit).
  void set_instance(const SourcePtr& s, PyObject* module);
  /// True when an object checked by identity (or a class) has been freed: the guards can never pass again.
  bool expired() const;
  /// The module set by set_instance (an address to compare; held weakly by its check), or nullptr; and
  /// where the frame holds it.
  PyObject* instance() const { return instance_; }
  const SourcePtr& instance_source() const { return instance_source_; }

  /// True when every check passes. Never raises: a path that cannot be resolved fails the check.
  /// After a call whose checks all passed, the tree keeps a snapshot (see Snapshot below) that the next calls
  /// check instead of the whole walk while the dicts it read are unchanged.
  bool check(const SourceRoots& roots) const;
  /// The first failing check, in words ("x: expected dtype float32, got float64").
  std::string explain_failure(const SourceRoots& roots) const;
  /// One line per check, for KILN_LOGS=guards and kiln.explain.
  std::vector<std::string> describe() const;
  size_t num_checks() const;

 public:
  struct Node;

 private:
  Node* node_for(const SourcePtr& s);
  bool check_node(const Node& n, PyObject* value, const SourceRoots& roots, std::string* why) const;
  std::vector<std::unique_ptr<Node>> nodes_;  // owns every node
  std::vector<Node*> roots_;                  // nodes whose source has no base
  std::map<std::string, Node*> by_path_;
  PyObject* globals_ = nullptr;
  GlobalState state_;
  bool any_global_state_ = false;
  PyObject* instance_ = nullptr;  // not owned: its identity check holds it weakly
  SourcePtr instance_source_;
  std::vector<std::pair<SourcePtr, SourcePtr>> same_objects_;
  bool check_same_objects(const SourceRoots& roots, std::string* why) const;
  SizeGuard size_guard_;
  bool check_size_relations(const SourceRoots& roots, std::string* why) const;
  bool evaluate(const SourceRoots& roots, std::string* why) const;


 public:
  /// What a passing walk found below the roots that carry an identity check (the traced `self`, a global
  /// module): an object reached from such a root only through dict lookups (`__dict__`, `_modules`,
  /// `_parameters`, ...) is the same object for as long as each dict on its way keeps its version tag (PEP 509:
  /// every change to a dict gives it a new one) and each object still has that `__dict__`. Its identity, its
  /// constants, its `__dict__` entries and its empty hook dicts hold as long as those dicts are unchanged; only
  /// what a dict cannot pin runs again (tensor metadata, types, list lengths, attributes read through
  /// descriptors). Any changed dict drops the snapshot for the whole walk, and a tree whose snapshots keep going
  /// stale stops taking them.
  struct Snapshot {
    // In the order the walk met them, so that each is reachable through the ones before it: every pointer is
    // borrowed, and is only read once the steps before it showed it alive.
    struct Step {
      PyObject* object;  // an object whose __dict__ must still be `dict`, or nullptr for a dict read by a lookup
      PyObject* dict;
      unsigned long long version;
    };
    struct Recheck {
      const Check* check;
      PyObject* value;
    };
    struct Subtree {  // a child reached otherwise (a getattr, a list item): walked whole from its parent
      const Node* node;
      PyObject* parent;
    };
    std::vector<std::pair<const Node*, const Check*>> pinned_roots;  // a root and its identity check
    std::vector<const Node*> other_roots;                            // walked whole each call
    std::vector<Step> steps;
    std::vector<Recheck> rechecks;         // run no Python code: tensors, types, hook dicts, built-in lengths
    std::vector<Recheck> python_rechecks;  // may run Python code: their values are held while they run
    std::vector<Subtree> subtrees;         // likewise
  };

 private:
  void build_snapshot(const SourceRoots& roots) const;
  /// 1: every check passes, 0: one fails, -1: the snapshot is stale (it was dropped).
  int check_snapshot(const SourceRoots& roots) const;
  mutable std::shared_ptr<const Snapshot> snapshot_;  // shared: a check holds it while Python code may run
  mutable int stale_snapshots_ = 0;  // snapshots in a row dropped by the next call; past a few, none are taken
};

/// Process-wide: guard checks a snapshot answered, and snapshots dropped because a dict they read changed.
struct SnapshotStats {
  long long hits = 0;
  long long stale = 0;
};
SnapshotStats& snapshot_stats();

/// Checks one tensor against a spec; on mismatch writes the reason if `why` is set.
bool tensor_matches(PyObject* value, const TensorSpec& spec, std::string* why);
/// Size `dim` of a tensor (value must be a torch.Tensor; dim in range).
int64_t tensor_size(PyObject* value, int dim);
/// Reads a tensor's spec (value must be a torch.Tensor).
TensorSpec tensor_spec_of(PyObject* value);
std::string describe_tensor_spec(const TensorSpec& spec);

}  // namespace kiln::guards
