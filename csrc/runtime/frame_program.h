#pragma once
// FrameProgram: what a traced frame's transformed code calls. It fetches the graph inputs through
// their Sources, runs the compiled graph, and rebuilds the frame's return value around the graph
// outputs. This header is torch-free so the tracer can build one without LibTorch headers.
#include <Python.h>

#include <memory>
#include <string>
#include <vector>

#include "common/source.h"

namespace kiln::graph {
class Graph;
}

namespace kiln::runtime {

class CompiledGraph;

/// The shape of a frame's return value around the graph's outputs.
/// How an assignment of OutputSpec::kStores is made (its code in the pair).
enum class StoreKind : int { kAttribute = 0, kItem = 1, kDictContents = 2, kListContents = 3, kCall = 4 };

struct OutputSpec {
  /// kSource: a value of the frame re-read through `source` (keeps its identity across a graph break);
  /// kBoundMethod: `object.__get__(children[0])` (a method of a rebuilt self);
  /// kRepeat: the list/dict built earlier in this output under memo slot `index` (one object, two places);
  /// kTypedTuple: a namedtuple or structseq (torch.return_types) of the children, `object` its class;
  /// kConstruct: `cls(*children[:-n], **{names: children[-n:]})` with `object` = (cls, names): a record
  /// (dataclass, ModelOutput) built the way the traced code built it, so __post_init__ runs as in eager;
  /// kNewObject: `object.__new__(cls)` with its __dict__ filled from `names` and the children, `object` = (cls, names):
  /// an instance of a plain user class made in the traced code; memo slot `index`, made before its attributes, so
  /// an attribute may refer back to it;
  /// kStores: children[0] (the frame's own output), then the assignments the traced code made, in order:
  /// children[1 + 2i] = target, children[2 + 2i] = value, `object` a tuple of (name, StoreKind) pairs:
  /// setattr(target, name, value); target[name] = value (a globals dict); or target's items replaced by
  /// value's (a dict or list from the frame that the traced code changed; name is None); or, kCall, value[0](*value[1],
  /// **value[2]) (a deferred log call; target unused).
  enum class Kind : unsigned char {
    kGraphOutput, kConstant, kTuple, kList, kDict, kSource, kBoundMethod, kRepeat, kTypedTuple, kConstruct, kStores,
    kNewObject,
    kCell  ///< the cell of the frame's free variable `index` (the frame passes its cells)
  };
  Kind kind = Kind::kConstant;
  int index = -1;              ///< kGraphOutput: index into the graph's outputs; kList/kDict/kConstruct/kNewObject: memo slot or -1
  PyObject* object = nullptr;  ///< kConstant: the value; kDict: tuple of keys; kBoundMethod: function (owned)
  SourcePtr source;            ///< kSource
  std::vector<OutputSpec> children;

  OutputSpec() = default;
  OutputSpec(OutputSpec&& o) noexcept;
  OutputSpec& operator=(OutputSpec&& o) noexcept;
  OutputSpec(const OutputSpec&) = delete;
  ~OutputSpec();
};

struct FrameProgramSpec {
  std::vector<SourcePtr> inputs;     ///< one per graph input, in order
  OutputSpec output;
  int num_locals_passed = 0;         ///< the transformed code passes localsplus[0..n) (the arguments)
  int num_freevars_passed = 0;       ///< followed by the free variables' cells (the program reads their contents)
  PyObject* globals = nullptr;       ///< borrowed from the function; kept alive by the code object
  PyObject* builtins = nullptr;
  std::string name;                  ///< for errors: the traced function's qualified name
};

/// Swaps the calling thread's frame-hook compiler for `compiler` (nullptr: none) and returns the one it replaced,
/// as frame::set_thread_compiler does. A FrameProgram suspends the hook with it around Python it calls (a user
/// backend, a record's constructor, a module's __setattr__), so those frames run as plain Python, as in eager.
using SwapThreadCompiler = void* (*)(void* compiler);
/// Registers the swap; called once, when kiln._C is initialised (bindings/module_compile.cpp). runtime/ executes
/// artefacts and does not know the frame hook, so the layer that knows both injects it.
void set_swap_thread_compiler(SwapThreadCompiler swap);

/// A namedtuple or structseq of type `type` holding the items of the plain tuple `items` (new reference,
/// NULL with a Python error set): structseqs take the tuple as their one argument, namedtuples are made as
/// their `_make` does (tuple.__new__), so neither runs user code.
PyObject* make_structured_tuple(PyTypeObject* type, PyObject* items);

/// Creates the Python-callable program object (new reference). `compiled` runs the graph.
PyObject* make_frame_program(FrameProgramSpec spec, std::shared_ptr<CompiledGraph> compiled);

}  // namespace kiln::runtime
