#pragma once
// The backend table (DESIGN.md "Backends plug in by table"): a captured graph + a backend name, or a user
// callable, + the compile options -> CompiledGraph. "kiln" is the pipeline (compile/pipeline.h); "eager" and
// "aot_eager" the eager interpreter; a Python callable compiles the graph its own way.
#include <Python.h>

#include <memory>
#include <string>
#include <vector>

#include "compile/options.h"
#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::compile {

/// Compiles `g` with the backend registered as `backend` ("eager", "aot_eager", "kiln"), or, when
/// `user_backend` is not NULL, with that Python callable: `user_backend(graph: kiln._C.Graph,
/// example_inputs: list[Tensor]) -> callable(list[Tensor]) -> list/tuple[Tensor]` (then `backend` only
/// names it in messages). `example_inputs` is a Python list of real tensors in graph input order (may
/// be NULL for the built-in backends). Unknown names raise a user error listing the known ones.
/// Call with the GIL held.
std::shared_ptr<runtime::CompiledGraph> compile_graph(std::shared_ptr<const graph::Graph> g, const std::string& backend,
                                                      PyObject* example_inputs, PyObject* user_backend,
                                                      const CompileOptions& options);

/// compile_graph for torch-free callers (the tracer): `graph` is the Python object of a kiln._C.Graph.
std::shared_ptr<runtime::CompiledGraph> compile_graph_object(PyObject* graph, const std::string& backend,
                                                             PyObject* example_inputs, PyObject* user_backend,
                                                             const CompileOptions& options);

/// The graph a kiln._C.Graph Python object holds (shared with it).
std::shared_ptr<graph::Graph> graph_from_object(PyObject* graph);

/// Names of the registered backends, sorted.
std::vector<std::string> backend_names();

}  // namespace kiln::compile
