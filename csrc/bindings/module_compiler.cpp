// kiln._C.compiler_stats / reset_compiler_stats / compiled_graph_summary / decomposed_ops: introspection of
// the "kiln" backend (fusion, C++ code generation and its cache).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/module_register.h"
#include "cache/kernel_cache.h"
#include "compile/pipeline.h"
#include "decomp/decompositions.h"
#include "runtime/autograd_graph.h"
#include "runtime/compiled_graph.h"
#include "runtime/kernel_graph.h"

namespace py = pybind11;

namespace kiln::bindings {

void register_compiler(py::module_& m) {
  m.def("set_compiled_autograd", &compile::set_compiled_autograd, py::arg("on"));
  m.def("compiled_autograd", &compile::compiled_autograd);
  m.def(
      "compiler_stats",
      [] {
        const auto& c = cache::stats();
        const auto& b = runtime::kiln_backend_stats();
        py::dict d;
        d["kernels_compiled"] = c.kernels_compiled;
        d["cache_hits"] = c.cache_hits;
        d["memory_hits"] = c.memory_hits;
        d["corrupt_entries"] = c.corrupt_entries;
        d["compile_failures"] = c.compile_failures;
        d["graph_cache_hits"] = c.graph_hits;
        d["joint_cache_hits"] = c.joint_hits;
        d["graphs_compiled"] = b.graphs_compiled;
        d["graphs_fallback"] = b.graphs_fallback;
        d["graphs_autograd"] = b.graphs_autograd;
        d["autograd_saved_bytes"] = b.autograd_saved_bytes;
        d["autograd_recomputed_nodes"] = b.autograd_recomputed_nodes;
        d["autograd_backward_variants"] = b.autograd_backward_variants;
        d["graphs_split"] = b.graphs_split;
        d["split_pieces"] = b.split_pieces;
        d["autograd_backward_runs"] = runtime::autograd_backward_runs().load();
        d["last_fallback_reason"] = b.last_fallback_reason;
        return d;
      },
      "counters of the kiln backend: kernels_compiled (C++ compiler runs), cache_hits (libraries loaded from "
      "KILN_CACHE_DIR), memory_hits, corrupt_entries, compile_failures, graph_cache_hits (whole compiled graphs read from KILN_CACHE_DIR: "
      "no passes, code generation or compiler), joint_cache_hits (autodiff's forward and backward graphs read "
      "back: no autodiff), graphs_compiled, graphs_fallback, "
      "last_fallback_reason, autograd_saved_bytes (saved forward intermediates of compiled autograd graphs, graph "
      "inputs excluded), autograd_recomputed_nodes (forward nodes their backward graphs recompute), autograd_backward_variants "
      "(backward graphs compiled again without the gradients of outputs nothing used), graphs_split "
      "(training graphs cut at DistributedDataParallel's gradient buckets), split_pieces (the pieces they were cut "
      "into, each its own autograd node), autograd_backward_runs (compiled backward graphs run)");
  m.def(
      "reset_compiler_stats",
      [] {
        cache::stats() = {};
        runtime::kiln_backend_stats() = {};
        runtime::autograd_backward_runs() = 0;
      },
      "zero compiler_stats()");
  m.def(
      "compiled_graph_summary",
      [](const std::shared_ptr<runtime::CompiledGraph>& compiled) -> py::object {
        const auto* s = runtime::kiln_graph_summary(*compiled);
        if (!s) return py::none();
        py::dict d;
        d["backend"] = s->backend;
        d["fallback_reason"] = s->fallback_reason;
        d["kernels"] = s->kernels;
        d["externs"] = s->externs;
        d["source"] = s->source;
        d["device"] = s->device;
        d["strategies"] = s->strategies;
        d["in_place"] = s->in_place;
        d["plan"] = s->plan;
        d["folded"] = s->folded;
        return d;
      },
      py::arg("compiled"),
      "for a graph compiled by the kiln backend: {backend: 'kiln'|'eager', fallback_reason, kernels: [names], "
      "externs: [op overloads], plan: the run plan's steps in order (kernel names and extern op overloads), folded: [values computed at compile time], source: generated C++ or CUDA C, device: 'cpu'|'cuda:N', strategies: per CUDA "
      "kernel}; None for other backends");
  m.def("set_cuda_ptx_check", &compile::set_cuda_ptx_check, py::arg("on"),
        "test switch: also emit every CPU graph's kernels as CUDA C and compile them to PTX with NVRTC");
  m.def(
      "cuda_ptx_check",
      [] {
        const auto& c = compile::cuda_ptx_check();
        py::dict d;
        d["compiled"] = c.compiled;
        d["failures"] = c.failures;
        return d;
      },
      "{compiled: graphs whose CUDA C compiled to PTX, failures: [NVRTC message + source]}");
  m.def("decomposed_ops", &decomp::decomposed_ops, "op overloads the kiln backend decomposes into prims");
}

}  // namespace kiln::bindings
