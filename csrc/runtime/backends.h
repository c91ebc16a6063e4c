#pragma once
// The backend table (DESIGN.md "Backends plug in by table"): a captured graph + a backend name, or a
// user callable, -> CompiledGraph.
#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// Compiles `g` with the backend registered as `backend` ("eager", "aot_eager", "kiln"), or, when
/// `user_backend` is not NULL, with that Python callable: `user_backend(graph: kiln._C.Graph,
/// example_inputs: list[Tensor]) -> callable(list[Tensor]) -> list/tuple[Tensor]` (then `backend` only
/// names it in messages). `example_inputs` is a Python list of real tensors in graph input order (may
/// be NULL for the built-in backends). Unknown names raise a user error listing the known ones.
/// Call with the GIL held.
std::shared_ptr<CompiledGraph> compile_graph(std::shared_ptr<const graph::Graph> g, const std::string& backend,
                                             PyObject* example_inputs, PyObject* user_backend);

/// Names of the registered backends, sorted.
std::vector<std::string> backend_names();

}  // namespace kiln::runtime
