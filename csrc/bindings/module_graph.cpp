// kiln._C.Graph, the recorder bridge (_graph_from_records, _enum_codes) and the backend entry points.
// Tensor conversions go through runtime/python_bridge.h so that this file needs no torch Python headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "bindings/module_register.h"
#include "cache/cache_journal.h"
#include "cache/graph_cache.h"
#include "cache/kernel_cache.h"
#include "common/error.h"
#include "graph/graph.h"
#include "graph/py_records.h"
#include "graph/specialise_sizes.h"
#include "graph/symbolic_sizes.h"
#include "compile/backends.h"
#include "runtime/python_bridge.h"

namespace py = pybind11;

namespace kiln::bindings {

namespace {
using graph::Graph;
using runtime::CompiledGraph;

// Python callables become user backends; strings name a registered backend.
std::shared_ptr<CompiledGraph> compile_from_python(const std::shared_ptr<Graph>& g, py::object backend,
                                                   py::object example_inputs,
                                                   const compile::CompileOptions& options = {}) {
  PyObject* examples = example_inputs.is_none() ? nullptr : example_inputs.ptr();
  if (py::isinstance<py::str>(backend))
    return compile::compile_graph(g, backend.cast<std::string>(), examples, nullptr, options);
  KILN_CHECK(PyCallable_Check(backend.ptr())) << "backend must be a name (" << py::repr(py::cast(compile::backend_names())).cast<std::string>()
                                              << ") or a callable, got " << Py_TYPE(backend.ptr())->tp_name;
  std::string name = py::hasattr(backend, "__name__") ? py::str(backend.attr("__name__")).cast<std::string>()
                                                      : std::string("<callable>");
  return compile::compile_graph(g, name, examples, backend.ptr(), options);
}

py::list run_compiled(CompiledGraph& compiled, py::handle inputs) {
  std::vector<at::Tensor> tensors = runtime::tensors_from_python(inputs.ptr(), "graph inputs");
  std::vector<at::Tensor> outputs;
  {
    // A graph recorded under autocast holds autocast's casts as nodes: its ops must not be cast again (as
    // runtime/frame_program.cpp runs the graphs of compiled frames).
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    // Built-in backends run without Python; user backends take the GIL back themselves.
    py::gil_scoped_release no_gil;
    outputs = compiled.run(tensors);
  }
  return py::reinterpret_steal<py::list>(runtime::tensors_to_python(outputs));
}

// graph::specialise_sizes with the symbols named as the graph prints them ({"s0": 12}); every symbol must be given.
std::shared_ptr<Graph> specialise(const Graph& g, const std::map<std::string, int64_t>& values) {
  graph::sym::Bindings bindings;
  size_t used = 0;
  if (g.symbolic) {
    for (const graph::SymbolOrigin& o : g.symbolic->symbols) {
      auto it = values.find(o.symbol.symbol_name());
      KILN_CHECK(it != values.end()) << "no value for size symbol " << o.symbol.symbol_name();
      bindings[o.symbol.symbol_id()] = it->second;
      ++used;
    }
  }
  KILN_CHECK(used == values.size()) << "the graph has " << used << " size symbols, " << values.size() << " were given";
  auto out = graph::specialise_sizes(g, bindings);
  out->verify();
  return out;
}

std::vector<std::string> op_names(const Graph& g) {
  std::vector<std::string> names;
  names.reserve(g.nodes.size());
  for (const auto& node : g.nodes) names.push_back(node.qualified_name());
  return names;
}
}  // namespace

void register_graph(py::module_& m) {
  py::class_<Graph, std::shared_ptr<Graph>>(m, "Graph", "An ATen-level graph captured by kiln (read-only here).")
      .def("__str__", &Graph::to_string)
      .def("__repr__", [](const Graph& g) {
        return "<kiln._C.Graph: " + std::to_string(g.inputs.size()) + " inputs, " + std::to_string(g.nodes.size()) +
               " nodes, " + std::to_string(g.outputs.size()) + " outputs>";
      })
      .def("__len__", [](const Graph& g) { return g.nodes.size(); })
      .def_property_readonly("num_nodes", [](const Graph& g) { return g.nodes.size(); })
      .def_property_readonly("inputs", [](const Graph& g) { return g.inputs.size(); }, "number of graph inputs")
      .def_property_readonly("outputs", [](const Graph& g) { return g.outputs.size(); }, "number of graph outputs")
      .def("ops", &op_names, "the op overload of each node, in order: ['aten::t.default', 'aten::addmm.default']")
      .def("verify", [](const Graph& g) { g.verify(); }, "raises InternalError if the graph is malformed")
      .def("to_json", &Graph::to_json, py::arg("indent") = 2)
      .def(
          "constants",
          [](const Graph& g) {
            py::dict constants;
            for (const graph::Value& v : g.values)
              if (v.is_constant && v.constant) constants[py::int_(v.id)] = py::reinterpret_borrow<py::object>(v.constant.get());
            return constants;
          },
          "{value id: tensor} of the constants the graph holds (to_json names them by meta only)");

  py::class_<CompiledGraph, std::shared_ptr<CompiledGraph>>(m, "CompiledGraph", "A graph ready to run.")
      .def("__call__", [](CompiledGraph& c, py::handle inputs) { return run_compiled(c, inputs); }, py::arg("inputs"));

  m.def(
      "_graph_from_records",
      [](py::handle values, py::handle nodes, py::handle outputs) {
        return graph::graph_from_records(values.ptr(), nodes.ptr(), outputs.ptr());
      },
      "kiln._fake.Recorder.finish's conversion of its records into a Graph (format: graph/py_records.h)");
  m.def(
      "_enum_codes", [] { return py::reinterpret_steal<py::dict>(runtime::enum_codes_for_python()); },
      "c10's numbering of dtypes, layouts, memory formats and device types, as graph/ stores them");
  m.def("backend_names", &compile::backend_names, "names of the registered backends");
  // kiln.export's bundle of compiled code (cache/cache_journal.h).
  m.def("_open_cache_journal", &cache::open_journal, "start recording the disk-cache entries compiles use");
  m.def(
      "_close_cache_journal",
      [] {
        py::list entries;
        for (const cache::JournalEntry& e : cache::close_journal())
          entries.append(py::make_tuple(e.kind, e.key, e.suffix, py::bytes(e.content)));
        return entries;
      },
      "stop recording: [(kind, key, suffix, content bytes)] of the entries used since _open_cache_journal");
  m.def(
      "_publish_cache_entry",
      [](const std::string& kind, const std::string& key, const std::string& suffix, const py::bytes& content) {
        return cache::publish_content(kind, key, suffix, std::string(content)).has_value();
      },
      "write one entry into the disk cache (atomically, with its checksum); False when the cache is off");
  m.def("_kiln_build", &cache::build_identity, "kiln's build as graph cache keys name it (size and mtime of _C)");
  m.def(
      "compile_graph",
      [](const std::shared_ptr<Graph>& g, py::object backend, py::object example_inputs, const std::string& mode,
         py::dict options) {
        return compile_from_python(g, backend, example_inputs, compile_options_from_python(mode, py::none(), options));
      },
      py::arg("graph"), py::arg("backend"), py::arg("example_inputs") = py::none(), py::arg("mode") = "default",
      py::arg("options") = py::dict(),
      "compile `graph` with a backend name or a user callable (graph, example_inputs) -> callable; `mode` and "
      "`options` are kiln.compile's, checked by kiln/api.py");
  m.def("_specialise_sizes", &specialise, py::arg("graph"), py::arg("symbols"),
        "the graph at the given symbol values ({'s0': 12}): concrete sizes and int arguments, no symbolic table "
        "(graph/specialise_sizes.h); what compile_graph compiles per binding of a graph with symbolic sizes");
  m.def(
      "run_graph",
      [](const std::shared_ptr<Graph>& g, py::object backend, py::handle inputs) {
        auto compiled = compile_from_python(g, backend, py::reinterpret_borrow<py::object>(inputs));
        return run_compiled(*compiled, inputs);
      },
      py::arg("graph"), py::arg("backend"), py::arg("inputs"),
      "compile `graph` with `backend` (a name or a callable) and run it once on `inputs` (for tests)");
}

}  // namespace kiln::bindings
