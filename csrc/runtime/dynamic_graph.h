#pragma once
// A graph with symbolic sizes (graph/symbolic_sizes.h), run at sizes it was not captured with (issue #25).
//
// Each call reads the symbols from the inputs (symbol s comes from size `dim` of input `input_index`), and looks the
// values up in a small cache of compiled specialisations. On a miss it checks that the graph holds at those values
// (each symbol's range and divisor, the assumptions, the specialisations: a failure is a user error, never a run),
// makes the concrete graph (graph/specialise_sizes.h) and compiles it through a factory the compile layer injects
// (runtime/ never includes compile/).
//
// Reading and checking a binding (SymbolBinder) is kept apart from the per-binding compile (the factory): once
// generated kernels take sizes as run-time arguments, one compiled artefact serves every binding, and only the
// specialisation step changes; the reading and the checks stay.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "graph/sym_expr.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// Reads a symbolic graph's size symbols from the run-time inputs and checks the relations the graph needs.
class SymbolBinder {
 public:
  /// `g` must have a symbolic table.
  explicit SymbolBinder(std::shared_ptr<const graph::Graph> g);

  /// Each symbol's value, in the order of g.symbolic->symbols, read from its origin. A user error when the input is
  /// missing, undefined or has too few dims.
  std::vector<int64_t> read(const std::vector<at::Tensor>& inputs) const;
  /// `values` (as read() returns them) as sym::Bindings.
  graph::sym::Bindings bindings(const std::vector<int64_t>& values) const;
  /// Throws a user error (kiln.errors.KilnError) naming the input, dim, value and relation when `values` break a
  /// symbol's range or divisor, an assumption or a specialisation of the graph: the caller's guards let through sizes
  /// the graph does not hold for, or a direct caller passed them.
  void check(const std::vector<int64_t>& values) const;
  /// Each input's sizes at `values`.
  std::vector<std::vector<int64_t>> input_sizes(const std::vector<int64_t>& values) const;
  /// Throws a user error when an input's rank or sizes differ from `expected` (the concrete graph's input sizes for
  /// this binding): the static dims are fixed as the symbolic ones are bound.
  static void check_input_sizes(const std::vector<std::vector<int64_t>>& expected,
                                const std::vector<at::Tensor>& inputs);

  /// "s0 = 7, s1 = 12", for logs.
  std::string binding_text(const std::vector<int64_t>& values) const;
  const graph::Graph& graph() const { return *graph_; }

 private:
  // "input 0 dim 1 = 7 (s1)" for each symbol of `e`.
  std::string describe_symbols(const graph::sym::Expr& e, const std::vector<int64_t>& values) const;
  std::shared_ptr<const graph::Graph> graph_;
};

/// Compiles the concrete graph of one binding. `inputs` are the tensors of the call that asked for it, at exactly its
/// sizes (empty when the binding is compiled before any call and no example inputs were given).
using SpecialisationFactory = std::function<std::shared_ptr<CompiledGraph>(
    std::shared_ptr<const graph::Graph> concrete, const std::vector<at::Tensor>& inputs)>;

/// The specialisations one DynamicGraph keeps, least recently used dropped first: enough for every sequence length a
/// serving workload brings (BERT over lengths 16..512 met 92 in 100 calls, and 64 made its steady pass compile again).
constexpr size_t kMaxSpecialisations = 512;

/// Runs a symbolic graph at any binding its checks allow, one compiled specialisation per binding.
/// Thread-safe: a lock guards the cache, and compiles run outside it (two threads that miss on the same binding both
/// compile; the first to finish is kept), so a factory that takes the GIL cannot deadlock with a caller holding it.
class DynamicGraph final : public CompiledGraph {
 public:
  /// `g` must have a symbolic table; `reenters_python`: the factory's graphs or the factory itself run Python (user
  /// backends).
  DynamicGraph(std::shared_ptr<const graph::Graph> g, SpecialisationFactory factory, bool reenters_python);

  /// Compiles the specialisation at the hints now (the binding the graph was captured at), so that compile errors
  /// surface where the graph is compiled; `example_inputs` go to the factory.
  void compile_at_hints(const std::vector<at::Tensor>& example_inputs);

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override;
  std::vector<at::Tensor> run_consuming(std::vector<at::Tensor>&& inputs) override;
  std::vector<at::Tensor> run_packing(std::vector<at::Tensor>&& inputs, bool consuming,
                                      const std::vector<bool>& packed) override;
  bool reenters_python() const override { return reenters_python_; }
  /// The most recently used specialisation (what cudagraph_status and kiln_graph_summary report).
  const CompiledGraph* wrapped() const override;
  /// Specialisations held now.
  size_t num_specialisations() const;

 private:
  struct Specialisation {
    std::vector<int64_t> values;  // the binding, in symbol order
    std::vector<std::vector<int64_t>> input_sizes;
    std::shared_ptr<CompiledGraph> compiled;
  };
  // The compiled graph for the inputs' binding: found in the cache, or checked, specialised and compiled.
  std::shared_ptr<CompiledGraph> specialisation_for(const std::vector<at::Tensor>& inputs);
  // The specialisation step: the concrete graph at `values`, compiled by the factory.
  Specialisation compile_specialisation(const std::vector<int64_t>& values, const std::vector<at::Tensor>& inputs);
  // Puts `s` first in the cache (or keeps the entry another thread put there first); returns the compiled graph.
  std::shared_ptr<CompiledGraph> insert(Specialisation s);

  SymbolBinder binder_;
  SpecialisationFactory factory_;
  bool reenters_python_;
  mutable std::mutex mutex_;
  std::vector<Specialisation> cache_;  // most recently used first
};

/// Process-wide counters, for kiln.stats(): specialisations compiled (one per new binding of a DynamicGraph, the one
/// at the hints included) and calls answered by a cached one.
struct DynamicGraphStats {
  std::atomic<int64_t> specialisations{0};
  std::atomic<int64_t> hits{0};
};
DynamicGraphStats& dynamic_graph_stats();
void reset_dynamic_graph_stats();

}  // namespace kiln::runtime
