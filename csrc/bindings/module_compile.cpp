// kiln._C's compile surface: the Compiler handle kiln.compile creates, the thread's active compiler,
// counters, reset and log switches.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/module_register.h"
#include "runtime/cuda_graphs.h"
#include "runtime/dynamic_graph.h"
#include "common/error.h"
#include "common/log.h"
#include "frame/frame.h"
#include "guards/guard_tree.h"
#include "compile/backends.h"
#include "runtime/frame_program.h"
#include "runtime/host_buffers.h"
#include "runtime/kernel_graph.h"
#include "trace/compile_frame.h"

namespace py = pybind11;

namespace kiln::bindings {

namespace {

struct CompilerHandle {
  std::unique_ptr<trace::KilnCompiler> compiler;
};

thread_local PyObject* tls_current = nullptr;  // the Python handle of this thread's compiler (owned)

py::object set_compiler(py::object handle) {
  trace::KilnCompiler* ptr = handle.is_none() ? nullptr : handle.cast<CompilerHandle&>().compiler.get();
  frame::set_thread_compiler(ptr);
  trace::set_active_compiler(ptr);
  PyObject* previous = tls_current;
  tls_current = handle.is_none() ? nullptr : handle.inc_ref().ptr();
  return previous ? py::reinterpret_steal<py::object>(previous) : py::none();
}

}  // namespace

compile::CompileOptions compile_options_from_python(const std::string& mode, py::object dynamic, py::dict options) {
  compile::CompileOptions parsed;
  parsed.mode = compile::parse_mode(mode);
  parsed.dynamic = dynamic.is_none() ? compile::Dynamic::kAutomatic
                   : dynamic.cast<bool>() ? compile::Dynamic::kDynamic
                                          : compile::Dynamic::kStatic;
  for (auto [key, value] : options) {
    const std::string name = py::str(key);
    if (name == "debug_dir") {
      parsed.debug_dir = py::str(value);
    } else if (name == "cudagraphs") {
      parsed.cudagraphs = value.cast<bool>();
    } else if (name == "autotune") {
      parsed.autotune = value.cast<bool>();
    } else {
      KILN_CHECK(false) << "unknown compile option '" << name << "' (known: autotune, cudagraphs, debug_dir)";
    }
  }
  if (parsed.uses_cudagraphs()) parsed.cuda_graph_pool = runtime::make_cuda_graph_pool();
  return parsed;
}

void register_compile(py::module_& m) {
  // Compiled frames suspend the hook around the Python they call; runtime/ reaches the hook only through this.
  runtime::set_swap_thread_compiler([](void* compiler) -> void* {
    return frame::set_thread_compiler(static_cast<frame::Compiler*>(compiler));
  });
  py::class_<CompilerHandle>(m, "Compiler")
      .def(py::init([](const std::string& backend, py::object user_backend, bool fullgraph, int recompile_limit,
                       py::list entry_codes, py::object explain_sink, bool trace_all, const std::string& mode,
                       py::object dynamic, py::dict compile_options) {
             trace::CompileOptions options;
             options.compile = compile_options_from_python(mode, dynamic, compile_options);
             options.trace_all = trace_all;
             options.backend = backend;
             options.fullgraph = fullgraph;
             options.recompile_limit = recompile_limit;
             if (!user_backend.is_none()) options.user_backend = user_backend.inc_ref().ptr();
             if (!explain_sink.is_none()) options.explain_sink = explain_sink.inc_ref().ptr();
             for (py::handle code : entry_codes) options.entry_codes.insert(code.inc_ref().ptr());
             auto handle = std::make_unique<CompilerHandle>();
             handle->compiler = std::make_unique<trace::KilnCompiler>(std::move(options));
             return handle;
           }),
           py::arg("backend"), py::arg("user_backend"), py::arg("fullgraph"), py::arg("recompile_limit"),
           py::arg("entry_codes"), py::arg("explain_sink"), py::arg("trace_all") = false, py::arg("mode") = "default",
           py::arg("dynamic") = py::none(), py::arg("options") = py::dict());
  m.def("set_compiler", &set_compiler, py::arg("compiler").none(true),
        "Sets this thread's compiler (None: none); returns the previous one.");
  m.def("stats", [] {
    const trace::Stats& s = trace::stats();
    frame::Counters c = frame::counters();
    py::dict d;
    d["frames_compiled"] = s.frames_compiled;
    d["cache_hits"] = c.hits;
    d["recompiles"] = s.recompiles;
    d["graph_breaks"] = s.graph_breaks;
    d["fallbacks"] = s.fallbacks;
    d["guard_snapshot_hits"] = guards::snapshot_stats().hits;
    d["guard_snapshots_stale"] = guards::snapshot_stats().stale;
    const runtime::CudaGraphStats& g = runtime::cuda_graph_stats();
    d["cudagraph_recordings"] = g.recordings;
    d["cudagraph_replays"] = g.replays;
    d["cudagraph_unrecorded_runs"] = g.unrecorded_runs;
    d["cudagraph_declined"] = g.declined;
    d["cudagraph_last_decline_reason"] = g.last_decline_reason;
    d["dynamic_specialisations"] = runtime::dynamic_graph_stats().specialisations.load();
    d["dynamic_hits"] = runtime::dynamic_graph_stats().hits.load();
    const runtime::KilnBackendStats& b = runtime::kiln_backend_stats();
    d["graphs_on_eager_interpreter"] = b.fallbacks_since_reset;
    d["last_eager_interpreter_reason"] = b.fallback_reason_since_reset;
    return d;
  });
  m.def("reset", [] {
    frame::reset_all();
    trace::stats() = trace::Stats();
    guards::snapshot_stats() = guards::SnapshotStats();
    runtime::cuda_graph_stats() = runtime::CudaGraphStats();
    runtime::reset_dynamic_graph_stats();
    runtime::kiln_backend_stats().fallbacks_since_reset = 0;
    runtime::kiln_backend_stats().fallback_reason_since_reset.clear();
    runtime::release_host_buffers();
  });
  m.def("host_buffer_stats", [] {
    const runtime::HostBufferStats s = runtime::host_buffer_stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["cached_bytes"] = s.cached_bytes;
    d["in_use_bytes"] = s.in_use_bytes;
    return d;
  }, "The CPU host buffer cache's counters (runtime/host_buffers.h).");
  m.def("backend_names", &compile::backend_names);
  m.def(
      "guard_benchmark",
      [](py::object target, py::args rest) {
        // guard_benchmark(fn_or_module, *args, iterations): seconds for `iterations` guard checks.
        KILN_CHECK(rest.size() >= 1) << "guard_benchmark(fn, *args, iterations)";
        long iterations = rest[rest.size() - 1].cast<long>();
        std::vector<PyObject*> locals;
        py::object fn = target;
        if (py::hasattr(target, "_kiln_compiler") && py::hasattr(target, "__wrapped__")) fn = target.attr("__wrapped__");
        py::module_ nn = py::module_::import("torch.nn");
        if (py::isinstance(target, nn.attr("Module"))) {
          fn = py::type::of(target).attr("forward");
          locals.push_back(target.ptr());
        }
        for (size_t i = 0; i + 1 < rest.size(); ++i) locals.push_back(rest[i].ptr());
        py::object code = fn.attr("__code__");
        return trace::time_guards((PyCodeObject*)code.ptr(), fn.attr("__globals__").ptr(),
                                  fn.attr("__closure__").is_none() ? nullptr : fn.attr("__closure__").ptr(), locals,
                                  iterations);
      });
  m.def("configure_logs", [](const std::string& spec) { log::configure(spec); });
  m.def(
      "log",
      [](const std::string& category, const std::string& text) {
        for (unsigned i = 0; i < static_cast<unsigned>(log::Category::count); ++i) {
          const auto c = static_cast<log::Category>(i);
          if (category != log::name(c)) continue;
          if (log::enabled(c)) log::emit(c, text);
          return;
        }
        KILN_CHECK(false) << "unknown log category '" << category << "'";
      },
      py::arg("category"), py::arg("text"),
      "writes one record of `category` (a KILN_LOGS name) to stderr when that category is on (Python's side of "
      "KILN_LOG)");
  m.def("cache_entries", [](py::object code) {
    std::vector<std::string> labels;
    for (const frame::CacheEntry* e : frame::entries_of((PyCodeObject*)code.ptr())) labels.push_back(e->label);
    return labels;
  });
}

}  // namespace kiln::bindings
