// The backend table (backends.h) and user backends: Python callables that compile a graph their own way.
#include "compile/backends.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/core/GradMode.h>

#include <functional>
#include <map>

#include "common/error.h"
#include "compile/pipeline.h"
#include "graph/symbolic_sizes.h"
#include "runtime/cuda_graphs.h"
#include "runtime/dynamic_graph.h"
#include "runtime/eager_interpreter.h"
#include "runtime/python_bridge.h"

namespace py = pybind11;

namespace kiln::compile {

namespace {

using runtime::CompiledGraph;
using BackendFactory = std::function<std::shared_ptr<CompiledGraph>(std::shared_ptr<const graph::Graph>,
                                                                    PyObject* example_inputs, const CompileOptions&)>;

// The real tensors of the graph's constants, by ValueId.
std::vector<at::Tensor> constant_tensors(const graph::Graph& g) {
  std::vector<at::Tensor> constants(g.values.size());
  for (const graph::Value& v : g.values) {
    if (!v.is_constant) continue;
    const bool tensor = v.constant.get() && runtime::tensor_or_none_from_python(v.constant.get(), constants[v.id]) &&
                        constants[v.id].defined();
    KILN_ASSERT(tensor) << "constant %" << v.id << " is not a tensor";
  }
  return constants;
}

std::shared_ptr<CompiledGraph> compile_eager(std::shared_ptr<const graph::Graph> g, PyObject*, const CompileOptions&) {
  std::vector<at::Tensor> constants = constant_tensors(*g);
  return runtime::make_eager_interpreter(std::move(g), std::move(constants));
}

std::shared_ptr<CompiledGraph> compile_kiln(std::shared_ptr<const graph::Graph> g, PyObject*, const CompileOptions& options) {
  return compile_kiln_graph(std::move(g), constant_tensors, options);
}

const std::map<std::string, BackendFactory>& backend_table() {
  static const std::map<std::string, BackendFactory> table = {
      {"eager", compile_eager},
      // "aot_eager" (ahead-of-time autodiff, then eager) is the op-by-op interpreter for now; the name exists
      // so that callers can already choose it.
      {"aot_eager", compile_eager},
      {"kiln", compile_kiln},
  };
  return table;
}

// A user backend's compiled callable, called back with the GIL for every run.
class PythonCallableGraph final : public runtime::CompiledGraph {
 public:
  PythonCallableGraph(py::object fn, std::string backend_name)
      : fn_(std::move(fn)), backend_name_(std::move(backend_name)) {}
  ~PythonCallableGraph() override {
    if (!Py_IsInitialized()) {  // interpreter gone: leak rather than touch it
      fn_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  bool reenters_python() const override { return true; }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    py::gil_scoped_acquire gil;
    py::object args = py::reinterpret_steal<py::object>(runtime::tensors_to_python(inputs));
    py::object result = fn_(args);
    at::Tensor single;
    if (runtime::tensor_or_none_from_python(result.ptr(), single) && single.defined()) return {single};
    return runtime::tensors_from_python(result.ptr(), ("the result of backend " + backend_name_).c_str());
  }

 private:
  py::object fn_;
  std::string backend_name_;
};

std::shared_ptr<runtime::CompiledGraph> compile_with_callable(std::shared_ptr<const graph::Graph> g,
                                                     const std::string& name, PyObject* user_backend,
                                                     PyObject* example_inputs) {
  py::object graph_obj = py::cast(std::const_pointer_cast<graph::Graph>(g));
  py::object examples = example_inputs ? py::reinterpret_borrow<py::object>(example_inputs)
                                       : py::reinterpret_steal<py::object>(PyList_New(0));
  py::object compiled = py::reinterpret_borrow<py::object>(user_backend)(graph_obj, examples);
  KILN_CHECK(PyCallable_Check(compiled.ptr()))
      << "backend " << name << " returned " << py::str(py::type::of(compiled)).cast<std::string>()
      << ", not a callable: a backend must return a function taking a list of tensors";
  return std::make_shared<PythonCallableGraph>(std::move(compiled), name);
}

// One reference to a Python object, released with the GIL (a DynamicGraph's factory may die on any thread).
std::shared_ptr<PyObject> hold_python(PyObject* obj) {
  if (!obj) return nullptr;
  Py_INCREF(obj);
  return std::shared_ptr<PyObject>(obj, [](PyObject* o) {
    if (!Py_IsInitialized()) return;  // interpreter gone: leak rather than touch it
    py::gil_scoped_acquire gil;
    Py_DECREF(o);
  });
}

// A graph with symbolic sizes runs as a runtime::DynamicGraph: one concrete graph per binding of its size symbols
// (graph::specialise_sizes), each compiled by this same entry point with the same backend and options, under the grad
// mode of this compile (a training graph keeps compile_kiln_graph's autodiff path per binding). What backends get per
// binding: the built-in ones the concrete graph (they never read example inputs); a user callable is called once per
// binding with the concrete graph and, as example inputs, the real tensors of the first call at that binding (for the
// binding at the hints, compiled here, `example_inputs` as given, or [] when none). The specialisation at the hints is
// compiled now, so compile errors surface here as they do for a graph without symbols.
// Each new binding lowers the graph again (passes, fusion, code generation: the cheap C++ part), with
// CompileOptions::size_arguments on: its kernels read their sizes at run time, so a binding whose schedule decisions
// match an earlier one's generates the same sources and finds them compiled in the kernel caches.
std::shared_ptr<CompiledGraph> compile_dynamic(std::shared_ptr<const graph::Graph> g, const std::string& backend,
                                               PyObject* example_inputs, PyObject* user_backend,
                                               const CompileOptions& options) {
  const bool grad_mode = at::GradMode::is_enabled();
  std::shared_ptr<PyObject> callable = hold_python(user_backend);
  CompileOptions per_binding = options;
  per_binding.size_arguments = true;  // every binding's kernels share one source (codegen/size_arguments.h)
  auto factory = [backend, callable, options = std::move(per_binding), grad_mode](std::shared_ptr<const graph::Graph> concrete,
                                                         const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_acquire gil;  // a miss inside run(), which callers make without the GIL
    at::AutoGradMode mode(grad_mode);
    py::object examples = inputs.empty() ? py::object()
                                         : py::reinterpret_steal<py::object>(runtime::tensors_to_python(inputs));
    return compile_graph(std::move(concrete), backend, examples ? examples.ptr() : nullptr, callable.get(), options);
  };
  auto dynamic = std::make_shared<runtime::DynamicGraph>(std::move(g), std::move(factory), user_backend != nullptr);
  std::vector<at::Tensor> examples;
  if (example_inputs && example_inputs != Py_None) {
    try {
      examples = runtime::tensors_from_python(example_inputs, "example inputs");
    } catch (const std::exception&) {  // not all tensors: the backend gets none
      PyErr_Clear();
      examples.clear();
    }
  }
  dynamic->compile_at_hints(examples);
  return dynamic;
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : backend_table()) names.push_back(name);
  return names;
}

std::shared_ptr<CompiledGraph> compile_graph(std::shared_ptr<const graph::Graph> g, const std::string& backend,
                                             PyObject* example_inputs, PyObject* user_backend, const CompileOptions& options) {
  KILN_ASSERT(g != nullptr) << "compile_graph without a graph";
  if (graph::has_symbolic_sizes(*g))
    return compile_dynamic(std::move(g), backend, example_inputs, user_backend, options);
  if (user_backend) {
    auto compiled = compile_with_callable(std::move(g), backend, user_backend, example_inputs);
    if (!options.cuda_graph_pool) return compiled;
    return runtime::make_cuda_graph_runner(std::move(compiled), options.cuda_graph_pool, SIZE_MAX, "graph",
                                           "backend '" + backend + "' is a Python callable (kiln records only its own "
                                           "backend's graphs)");
  }
  const auto& table = backend_table();
  auto it = table.find(backend);
  if (it == table.end()) {
    std::string known;
    for (const auto& name : backend_names()) known += (known.empty() ? "" : ", ") + name;
    KILN_CHECK(false) << "unknown backend '" << backend << "': known backends are " << known
                      << ", or pass a callable (graph, example_inputs) -> callable";
  }
  std::shared_ptr<CompiledGraph> compiled = it->second(std::move(g), example_inputs, options);
  // The "kiln" backend wraps its graphs itself (compile/pipeline.cpp: they report a status); the others run op by op,
  // which kiln does not record: say so where kiln.explain looks.
  if (!options.cuda_graph_pool || !compiled->cudagraph_status().empty()) return compiled;
  return runtime::make_cuda_graph_runner(std::move(compiled), options.cuda_graph_pool, SIZE_MAX, "graph",
                                         "backend '" + backend + "' runs the graph op by op (CUDA graphs need " +
                                         "backend='kiln')");
}

std::shared_ptr<graph::Graph> graph_from_object(PyObject* graph) {
  return py::cast<std::shared_ptr<graph::Graph>>(py::handle(graph));
}

std::shared_ptr<CompiledGraph> compile_graph_object(PyObject* graph, const std::string& backend, PyObject* example_inputs,
                                                    PyObject* user_backend, const CompileOptions& options) {
  auto g = py::cast<std::shared_ptr<graph::Graph>>(py::handle(graph));
  return compile_graph(std::move(g), backend, example_inputs, user_backend, options);
}

}  // namespace kiln::compile
