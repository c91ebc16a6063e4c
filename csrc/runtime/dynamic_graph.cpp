// DynamicGraph (dynamic_graph.h): a symbolic graph run at any binding its checks allow. The binder reads and checks;
// the cache maps a binding to the graph compiled for it; compile_specialisation is the one step that changes once a
// compiled artefact takes its sizes at run time.
#include "runtime/dynamic_graph.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "common/error.h"
#include "common/log.h"
#include "graph/specialise_sizes.h"
#include "graph/symbolic_sizes.h"

namespace kiln::runtime {

namespace sym = graph::sym;

// ---- SymbolBinder -------------------------------------------------------------------------------------------------

SymbolBinder::SymbolBinder(std::shared_ptr<const graph::Graph> g) : graph_(std::move(g)) {
  KILN_ASSERT(graph_ && graph_->symbolic) << "SymbolBinder: a graph without symbolic sizes";
}

std::vector<int64_t> SymbolBinder::read(const std::vector<at::Tensor>& inputs) const {
  const auto& symbols = graph_->symbolic->symbols;
  std::vector<int64_t> values(symbols.size());
  for (size_t i = 0; i < symbols.size(); ++i) {
    const graph::SymbolOrigin& o = symbols[i];
    KILN_CHECK(static_cast<size_t>(o.input_index) < inputs.size())
        << "the compiled graph takes " << graph_->inputs.size() << " inputs and reads size symbol "
        << o.symbol.to_string() << " from input " << o.input_index << ", but it was called with " << inputs.size();
    const at::Tensor& t = inputs[o.input_index];
    KILN_CHECK(t.defined() && o.dim < t.dim())
        << "input " << o.input_index << " of the compiled graph has "
        << (t.defined() ? std::to_string(t.dim()) + " dims" : std::string("no tensor"))
        << "; the graph reads size symbol "
        << o.symbol.to_string() << " from its dim " << o.dim;
    values[i] = t.size(o.dim);
  }
  return values;
}

std::vector<std::vector<int64_t>> SymbolBinder::input_sizes(const std::vector<int64_t>& values) const {
  const sym::Bindings b = bindings(values);
  std::vector<std::vector<int64_t>> out;
  for (graph::ValueId id : graph_->inputs) out.push_back(graph::evaluate_meta(*graph_, id, b).sizes);
  return out;
}

sym::Bindings SymbolBinder::bindings(const std::vector<int64_t>& values) const {
  const auto& symbols = graph_->symbolic->symbols;
  KILN_ASSERT_EQ(values.size(), symbols.size());
  sym::Bindings out;
  for (size_t i = 0; i < symbols.size(); ++i) out[symbols[i].symbol.symbol_id()] = values[i];
  return out;
}

std::string SymbolBinder::binding_text(const std::vector<int64_t>& values) const {
  const auto& symbols = graph_->symbolic->symbols;
  std::ostringstream os;
  for (size_t i = 0; i < values.size() && i < symbols.size(); ++i)
    os << (i ? ", " : "") << symbols[i].symbol.to_string() << " = " << values[i];
  return os.str();
}

std::string SymbolBinder::describe_symbols(const sym::Expr& e, const std::vector<int64_t>& values) const {
  const auto& symbols = graph_->symbolic->symbols;
  std::ostringstream os;
  for (const sym::Expr& s : e.free_symbols()) {
    for (size_t i = 0; i < symbols.size(); ++i) {
      if (symbols[i].symbol != s) continue;
      os << (os.tellp() > 0 ? ", " : "") << "input " << symbols[i].input_index << " dim " << symbols[i].dim << " = "
         << values[i] << " (" << s.to_string() << ")";
    }
  }
  return os.str();
}

void SymbolBinder::check(const std::vector<int64_t>& values) const {
  const graph::SymbolicSizes& s = *graph_->symbolic;
  const sym::Bindings b = bindings(values);
  std::vector<std::string> failures;
  std::vector<sym::SymbolId> pinned;  // symbols whose specialisation failed: their range says the same again
  for (const graph::Specialisation& sp : s.specialisations) {
    auto it = b.find(sp.symbol.symbol_id());
    if (it == b.end() || it->second == sp.value) continue;
    pinned.push_back(sp.symbol.symbol_id());
    failures.push_back(describe_symbols(sp.symbol, values) + ": the graph was specialised to " + sp.symbol.to_string() +
                       " == " + std::to_string(sp.value) + " (" + sp.reason + ")");
  }
  for (size_t i = 0; i < s.symbols.size(); ++i) {
    const sym::Expr& symbol = s.symbols[i].symbol;
    if (std::find(pinned.begin(), pinned.end(), symbol.symbol_id()) != pinned.end()) continue;
    const sym::Range range = s.facts.range(symbol.symbol_id());
    const int64_t divisor = s.facts.divisor(symbol.symbol_id());
    if (!range.contains(values[i]))
      failures.push_back(describe_symbols(symbol, values) + ": outside " + symbol.to_string() + "'s range " +
                         range.to_string() + (values[i] < 2 ? " (sizes 0 and 1 are never symbolic)" : ""));
    else if (divisor > 1 && values[i] % divisor != 0)
      failures.push_back(describe_symbols(symbol, values) + ": the graph needs " + symbol.to_string() +
                         " to be a multiple of " + std::to_string(divisor));
  }
  for (const graph::shape::Assumption& a : s.assumptions) {
    bool holds = false;
    try {
      holds = a.holds(b);
    } catch (const Error&) {  // a division by zero or an overflow at these sizes: it does not hold
    }
    if (!holds)
      failures.push_back(describe_symbols(a.lhs - a.rhs, values) + ": the graph needs " + a.to_string() + " (" +
                         a.reason + ")");
  }
  if (failures.empty()) return;
  std::ostringstream os;
  os << "the compiled graph does not hold at these input sizes, so it was not run (the guards of its cache entry "
        "should have sent this call elsewhere; a direct caller must pass sizes the graph holds for):";
  for (const std::string& f : failures) os << "\n  " << f;
  KILN_CHECK(false) << os.str();
}

void SymbolBinder::check_input_sizes(const std::vector<std::vector<int64_t>>& expected,
                                     const std::vector<at::Tensor>& inputs) {
  KILN_CHECK(inputs.size() == expected.size())
      << "the compiled graph takes " << expected.size() << " inputs, but it was called with " << inputs.size();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    const at::IntArrayRef sizes = inputs[i].sizes();
    if (sizes.size() == expected[i].size() && std::equal(sizes.begin(), sizes.end(), expected[i].begin())) continue;
    std::ostringstream want;
    for (size_t d = 0; d < expected[i].size(); ++d) want << (d ? ", " : "") << expected[i][d];
    KILN_CHECK(false) << "input " << i << " of the compiled graph has sizes " << sizes << "; at these values of its "
                      << "size symbols the graph takes [" << want.str() << "] (only the dims marked dynamic may vary)";
  }
}

// ---- DynamicGraph -------------------------------------------------------------------------------------------------

DynamicGraph::DynamicGraph(std::shared_ptr<const graph::Graph> g, SpecialisationFactory factory, bool reenters_python)
    : binder_(std::move(g)), factory_(std::move(factory)), reenters_python_(reenters_python) {
  KILN_ASSERT(factory_) << "DynamicGraph without a factory";
}

void DynamicGraph::compile_at_hints(const std::vector<at::Tensor>& example_inputs) {
  std::vector<int64_t> hints;
  for (const graph::SymbolOrigin& o : binder_.graph().symbolic->symbols) hints.push_back(o.hint);
  binder_.check(hints);
  insert(compile_specialisation(hints, example_inputs));
}

DynamicGraph::Specialisation DynamicGraph::compile_specialisation(const std::vector<int64_t>& values,
                                                                   const std::vector<at::Tensor>& inputs) {
  std::shared_ptr<const graph::Graph> concrete = graph::specialise_sizes(binder_.graph(), binder_.bindings(values));
  Specialisation s;
  s.values = values;
  for (graph::ValueId id : concrete->inputs) s.input_sizes.push_back(concrete->value(id).meta.sizes);  // for hits
  KILN_LOG(recompiles) << "dynamic graph: compiling the specialisation at " << binder_.binding_text(values);
  s.compiled = factory_(std::move(concrete), inputs);
  KILN_ASSERT(s.compiled) << "DynamicGraph: the factory returned no graph";
  dynamic_graph_stats().specialisations++;
  return s;
}

std::shared_ptr<CompiledGraph> DynamicGraph::insert(Specialisation s) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto same = std::find_if(cache_.begin(), cache_.end(), [&](const Specialisation& e) { return e.values == s.values; });
  if (same != cache_.end()) {  // another thread compiled it first: keep one
    std::rotate(cache_.begin(), same, same + 1);
    return cache_.front().compiled;
  }
  if (cache_.size() >= kMaxSpecialisations) cache_.pop_back();
  cache_.insert(cache_.begin(), std::move(s));
  return cache_.front().compiled;
}

std::shared_ptr<CompiledGraph> DynamicGraph::specialisation_for(const std::vector<at::Tensor>& inputs) {
  const std::vector<int64_t> values = binder_.read(inputs);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Most recently used first: a loop over one size finds it at once.
    auto hit = std::find_if(cache_.begin(), cache_.end(), [&](const Specialisation& e) { return e.values == values; });
    if (hit != cache_.end()) {
      std::rotate(cache_.begin(), hit, hit + 1);
      std::shared_ptr<CompiledGraph> compiled = cache_.front().compiled;
      const std::vector<std::vector<int64_t>>& input_sizes = cache_.front().input_sizes;
      SymbolBinder::check_input_sizes(input_sizes, inputs);
      dynamic_graph_stats().hits++;
      return compiled;
    }
  }
  binder_.check(values);
  SymbolBinder::check_input_sizes(binder_.input_sizes(values), inputs);
  return insert(compile_specialisation(values, inputs));
}

std::vector<at::Tensor> DynamicGraph::run(const std::vector<at::Tensor>& inputs) {
  return specialisation_for(inputs)->run(inputs);
}

std::vector<at::Tensor> DynamicGraph::run_consuming(std::vector<at::Tensor>&& inputs) {
  return specialisation_for(inputs)->run_consuming(std::move(inputs));
}

std::vector<at::Tensor> DynamicGraph::run_packing(std::vector<at::Tensor>&& inputs, bool consuming,
                                                  const std::vector<bool>& packed) {
  return specialisation_for(inputs)->run_packing(std::move(inputs), consuming, packed);
}

const CompiledGraph* DynamicGraph::wrapped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cache_.empty() ? nullptr : cache_.front().compiled.get();
}

size_t DynamicGraph::num_specialisations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cache_.size();
}

DynamicGraphStats& dynamic_graph_stats() {
  static DynamicGraphStats stats;
  return stats;
}

void reset_dynamic_graph_stats() {
  dynamic_graph_stats().specialisations = 0;
  dynamic_graph_stats().hits = 0;
}

}  // namespace kiln::runtime
