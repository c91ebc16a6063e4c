// specialise_sizes (specialise_sizes.h): the concrete graph of a symbolic one at given symbol values. Evaluation only:
// which bindings the graph holds for is the caller's question (its assumptions and specialisations).
#include "graph/specialise_sizes.h"

#include "common/error.h"
#include "graph/symbolic_sizes.h"

namespace kiln::graph {

std::shared_ptr<Graph> specialise_sizes(const Graph& g, const sym::Bindings& bindings) {
  auto out = std::make_shared<Graph>(g);
  out->symbolic = nullptr;
  if (!g.symbolic) return out;
  for (Value& v : out->values)
    if (v.is_tensor) v.meta = evaluate_meta(g, v.id, bindings);
  for (const SymbolicIntArg& a : g.symbolic->int_args) {
    KILN_ASSERT(a.node >= 0 && static_cast<size_t>(a.node) < out->nodes.size() && a.arg >= 0 &&
                static_cast<size_t>(a.arg) < out->nodes[a.node].args.size())
        << "specialise_sizes: a symbolic int argument names node " << a.node << " argument " << a.arg;
    ArgValue& arg = out->nodes[a.node].args[a.arg];
    const int64_t value = a.value.evaluate(bindings);
    if (auto* list = std::get_if<std::vector<int64_t>>(&arg); list && a.element >= 0) {
      KILN_ASSERT(static_cast<size_t>(a.element) < list->size())
          << "specialise_sizes: node " << a.node << " argument " << a.arg << " has no element " << a.element;
      (*list)[a.element] = value;
    } else {
      auto* i = std::get_if<int64_t>(&arg);
      KILN_ASSERT(i && a.element < 0) << "specialise_sizes: node " << a.node << " ("
                                      << g.nodes[a.node].qualified_name() << ") argument " << a.arg
                                      << " is not the int or int list its symbolic int argument says";
      *i = value;
    }
  }
  return out;
}

}  // namespace kiln::graph
