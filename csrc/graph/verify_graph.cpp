// Graph::verify: the graph-level verifier (STYLE.md 4), run at stage boundaries and under KILN_VERIFY=1.
// With symbolic sizes it also checks that they evaluate to the concrete metas at the hints.
// It checks structure only (definitions before uses, consistent bookkeeping, meta present); whether an
// op accepts its arguments is the dispatcher's business at run time.
#include <sstream>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/symbolic_sizes.h"

namespace kiln::graph {

namespace {
std::string describe(const Graph& g, NodeIndex n) {
  const Node& node = g.nodes[n];
  std::ostringstream os;
  os << "node " << n << " (" << node.qualified_name() << ", inputs:";
  for (const ArgValue& arg : node.args)
    for_each_tensor(arg, [&](ValueId id) {
      os << " %" << id;
      if (id >= 0 && static_cast<size_t>(id) < g.values.size()) os << " " << meta_to_string(g.values[id].meta);
    });
  os << ")";
  return os.str();
}

void check_meta(const Value& v) {
  KILN_ASSERT(!v.is_tensor || v.meta.sizes.size() == v.meta.strides.size())
      << "graph verifier: value %" << v.id << " has " << v.meta.sizes.size() << " sizes but "
      << v.meta.strides.size() << " strides";
  for (int64_t s : v.meta.sizes)
    KILN_ASSERT(s >= 0) << "graph verifier: value %" << v.id << " has a negative size " << s;
}
}  // namespace

void Graph::verify(bool constants_hold_tensors) const {
  const auto num_values = static_cast<ValueId>(values.size());
  for (ValueId id = 0; id < num_values; ++id) {
    const Value& v = values[id];
    KILN_ASSERT_EQ(v.id, id) << "graph verifier: value table out of order";
    const int kinds = int(v.is_input) + int(v.is_constant) + int(v.producer >= 0);
    KILN_ASSERT_EQ(kinds, 1) << "graph verifier: value %" << id
                             << " must be exactly one of input, constant, node output";
    KILN_ASSERT(!v.is_constant || v.constant || !constants_hold_tensors) << "graph verifier: constant %" << id << " holds no tensor";
    check_meta(v);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    KILN_ASSERT(inputs[i] >= 0 && inputs[i] < num_values) << "graph verifier: input " << i << " is undefined";
    const Value& v = values[inputs[i]];
    KILN_ASSERT(v.is_input && v.input_index == static_cast<int32_t>(i))
        << "graph verifier: input " << i << " names %" << v.id << " which is not input " << i;
  }

  // A value is defined once its producer has run; inputs and constants are defined from the start.
  std::vector<bool> defined(values.size(), false);
  for (const Value& v : values) defined[v.id] = v.is_input || v.is_constant;
  for (NodeIndex n = 0; n < static_cast<NodeIndex>(nodes.size()); ++n) {
    const Node& node = nodes[n];
    KILN_ASSERT_EQ(node.args.size(), node.arg_names.size()) << "graph verifier: " << describe(*this, n);
    KILN_ASSERT(node.num_positional >= 0 && static_cast<size_t>(node.num_positional) <= node.args.size())
        << "graph verifier: " << describe(*this, n) << " has num_positional " << node.num_positional;
    for (const ArgValue& arg : node.args)
      for_each_tensor(arg, [&](ValueId id) {
        KILN_ASSERT(id >= 0 && id < num_values && defined[id])
            << "graph verifier: " << describe(*this, n) << " uses %" << id << " before it is defined";
      });
    for (ValueId out : node.outputs) {
      KILN_ASSERT(out >= 0 && out < num_values) << "graph verifier: " << describe(*this, n)
                                                << " defines unknown value %" << out;
      KILN_ASSERT(values[out].producer == n && !defined[out])
          << "graph verifier: " << describe(*this, n) << " output %" << out << " is defined twice";
      defined[out] = true;
    }
  }
  for (ValueId out : outputs)
    KILN_ASSERT(out >= 0 && out < num_values && defined[out]) << "graph verifier: graph output %" << out
                                                              << " is never defined";
  verify_symbolic_sizes(*this);
}

}  // namespace kiln::graph
