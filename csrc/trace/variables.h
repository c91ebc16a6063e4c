#pragma once
// Values on the tracer's symbolic stack and in its symbolic locals.
//
// Each Var stands for one Python value the traced code handles. Tensors are fakes (meta tensors
// the recorder runs ops on); Python values known at trace time are kept as real objects; tuples,
// lists and dicts are kept structurally so that tensors inside them stay symbolic. A Var read from
// outside the traced code carries the Source it came from (its guards are already recorded).
#include <Python.h>

#include <memory>
#include <string>
#include <vector>

#include "common/source.h"
#include "graph/sym_expr.h"

namespace kiln::trace {

enum class VarKind : unsigned char {
  kNull,      ///< the NULL CPython pushes before some callables
  kConst,     ///< a Python value known at trace time (numbers, strings, functions, modules, classes...)
  kTensor,    ///< a fake tensor (value = the meta tensor); real_type = the Python type of the real tensor
  kModule,    ///< an nn.Module instance (value = the real module)
  kTuple,     ///< items; real_type = a namedtuple or structseq class (torch.return_types), else nullptr
  kList,      ///< items (mutable: shared between aliases)
  kDict,      ///< keys (constants) + items
  kMethod,    ///< a Python function bound to items[0] (value = the function)
  kIterator,  ///< over items, next position `position`
  kSlice,     ///< items = start, stop, step
  /// An instance of a record class (a dataclass, a HuggingFace-style ModelOutput) built inside the traced
  /// code: real_type = the class, items = the constructor's arguments (keyword values last, named by
  /// `keys`), value = the same instance built on the fakes at trace time (what attribute reads consult),
  /// built_from = tuple of the Python objects the items were converted to (maps its attributes back to Vars).
  kObject,
  /// super(cls, obj) made in traced code: items = {cls (a kConst class), obj}. Attribute reads look the name
  /// up along type(obj).__mro__ after cls and bind what they find to obj.
  kSuper,
  /// A cell of the traced frame captured by a closure made in the trace (LOAD_CLOSURE): items[0] = its
  /// contents (nullptr while empty). Shared by the frame and the closures, so later stores are seen by both.
  kCell,
  /// A closure made by MAKE_FUNCTION in traced code: value = a real function with the same code, globals,
  /// name and constant defaults (for argument binding; its own cells stay empty); items = its closure's kCell
  /// Vars, co_freevars order. (A function made without a closure is a plain kConst.)
  kFunction,
  /// functools.partial(fn, *args, **kwargs) made in traced code: items = {fn, args..., keyword values...};
  /// keys = the keyword names (the last keys.size() items).
  kPartial,
  /// The Token of a ContextVar.set traced in this frame: value = the ContextVar, items[0] = the value set.
  /// No graph output or graph break can rebuild it, so a frame that returns or breaks between a set and its
  /// reset runs eagerly: set/reset pairs inside one trace leave the process state as they found it.
  kToken,
  /// A generator made by calling a generator function (a generator expression's included) in traced code:
  /// `frame` is its paused translator. Iterated lazily, one YIELD_VALUE per item, so its body interleaves
  /// with the loop that consumes it as in eager. Never rebuilt in Python: a break with one live is refused.
  kGenerator,
  /// An instance of a plain user class (user_objects.cpp says which) made by calling the class in traced code. It has
  /// no Python object while the trace runs: real_type = the class (a reference held in built_from), keys/items = its
  /// instance attributes in __dict__ order (the attribute table that __init__ and later stores fill), class_source =
  /// where the class was read (its class attributes are read through it, guarded). It becomes a real object only where
  /// it leaves the trace (OutputSpec::kNewObject), once per Var whatever the number of paths.
  kUserObject,
  /// An int computed from tensor sizes under dynamic shapes (trace/symbolic_ints.h): value = its value at trace time
  /// (a Python int), sym = what it is over the size symbols. Handed to Python as a value it is pinned to that value.
  kSymInt,
  /// A set or frozenset (real_type) made in traced code, or one of constants read from the frame (source set, never
  /// changed by the trace): items = its elements in the order the real set iterates them (sets.cpp). Elements are
  /// constants, modules and tensors, hashed as eager hashes them: the trace answers membership and iteration order
  /// with a real set of their trace-time objects.
  kSet,
};

struct Var;
using VarPtr = std::shared_ptr<Var>;
class InstructionTranslator;

struct Var {
  VarKind kind = VarKind::kConst;
  PyObject* value = nullptr;  ///< owned
  PyTypeObject* real_type = nullptr;
  std::vector<VarPtr> items;
  std::vector<PyObject*> keys;  ///< owned, for kDict
  size_t position = 0;
  PyObject* built_from = nullptr;  ///< owned; kObject: what it was built from; kDict from the frame: the real dict
  SourcePtr source;
  /// A kConst from `source` guarded by its type only (a plain object: each call may pass a new one).
  /// Its identity was not pinned, so outputs re-read it from the source and `is` on it is not folded.
  bool by_type = false;
  /// An exception the traced code raised and caught (interpreter_except.cpp): the traceback eager gives it cannot
  /// be rebuilt, so it may not leave the trace (a return or a value live at a break).
  bool caught = false;
  /// A kDict view the trace may read but never change (a kUserObject's __dict__, whose changes would miss the table).
  bool read_only = false;
  std::shared_ptr<InstructionTranslator> frame;  ///< kGenerator only
  SourcePtr class_source;  ///< kUserObject only: where its class was read (nullptr when unknown)
  graph::sym::Expr sym;    ///< kSymInt only

  ~Var();
  Var() = default;
  Var(const Var&) = delete;
  Var& operator=(const Var&) = delete;

  bool is(VarKind k) const { return kind == k; }
  /// A short description for graph-break messages ("Tensor", "int 3", "list[2]", "module Linear").
  std::string describe() const;
};

VarPtr make_null();
/// Steals nothing: takes a new reference of `value`.
VarPtr make_const(PyObject* value, SourcePtr source = nullptr);
/// Steals `value` (convenient right after a Python call); returns nullptr when value is NULL.
VarPtr make_const_steal(PyObject* value);
VarPtr make_tensor(PyObject* fake, PyTypeObject* real_type, SourcePtr source = nullptr);
VarPtr make_module(PyObject* module, SourcePtr source);
VarPtr make_sequence(VarKind kind, std::vector<VarPtr> items, SourcePtr source = nullptr);
VarPtr make_dict(std::vector<PyObject*> keys_new_refs, std::vector<VarPtr> items, SourcePtr source = nullptr);
VarPtr make_method(PyObject* function, VarPtr self);
/// A namedtuple / structseq of `items` (type = its class); nullptr type gives a plain tuple.
VarPtr make_typed_tuple(PyTypeObject* type, std::vector<VarPtr> items);
/// A kObject (see VarKind): steals nothing.
VarPtr make_object(PyObject* instance, std::vector<VarPtr> args, std::vector<PyObject*> kwnames_new_refs,
                   PyObject* built_from);

/// A kUserObject of class `cls` with no attributes yet (see VarKind).
VarPtr make_user_object(PyTypeObject* cls, SourcePtr class_source);

/// The factory a zero-argument `super` call in a method resolves to: calling it gives make_super(cls, obj).
VarPtr make_super_factory(VarPtr cls, VarPtr obj);
bool is_super_factory(const VarPtr& v);
VarPtr make_super(VarPtr cls, VarPtr obj);
VarPtr make_cell(VarPtr contents);
/// A kSet over `items` (already distinct and in the real set's order: Tracer::make_set builds one from any items).
VarPtr make_set_var(PyTypeObject* type, std::vector<VarPtr> items, SourcePtr source = nullptr);

/// True when `v` is a kSymInt, or a container or slice holding one.
bool holds_symbolic_int(const VarPtr& v);
/// True when the whole Var (recursively) is known at trace time.
bool is_constant(const VarPtr& v);
/// A snapshot of dict.keys() or dict.items() made in the trace: a kList typed as the view (real_type).
inline bool is_dict_view(const VarPtr& v) {
  return v->is(VarKind::kList) && (v->real_type == &PyDictKeys_Type || v->real_type == &PyDictItems_Type);
}
/// The Python object a Var stands for at trace time: fakes for tensors, new tuples/lists/dicts for
/// containers. New reference; throws kiln Unsupported for kinds that have none (NULL, iterators).
PyObject* to_python(const VarPtr& v);

}  // namespace kiln::trace
