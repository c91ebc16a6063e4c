// Buffer updates as functional ops plus a write-back (passes/functionalize_buffer_updates.h).
//
// Design: a train-mode BatchNorm records `num_batches_tracked.add_(1)`, an in-place op on a graph input.
// The compiled forward cannot keep it (the kernel backend refuses in-place ops on inputs), and need not:
// the forward performs the update once and the backward never sees it. So the op becomes its functional
// twin (for the ops the op table marks with buffer_update), later readers read the twin's result, and the
// runtime copies the last version into the input after the forward has run (as eager, the input's storage
// changes and its version counter moves).
// This is exact only while nothing else shares the input's storage inside the graph, so an input that is
// viewed across one of its updates (or returned as a view), written by any other op, or handed to an op that
// updates its arguments itself (BatchNorm's running statistics: the op table's mutates_only_buffers) is left
// alone: its in-place op stays and the joint builder refuses the graph.
#include "passes/functionalize_buffer_updates.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "common/error.h"
#include "graph/op_facts.h"

namespace kiln::passes {

namespace {

using graph::Graph;
using graph::Node;
using graph::ValueId;

template <typename Fn>
void for_each_tensor_arg(const Node& node, Fn&& fn) {
  for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, fn);
}

bool is_dense_contiguous(const graph::TensorMeta& meta) {
  const std::vector<int64_t> expected = graph::contiguous_strides(meta.sizes);
  for (size_t i = 0; i < meta.sizes.size(); ++i)
    if (meta.sizes[i] != 1 && meta.strides[i] != expected[i]) return false;
  return meta.storage_offset == 0;
}

// True when the functional twin of `node` (an op with `facts`) gives exactly the in-place result: every tensor
// operand has the written tensor's dtype, and no Python float would promote an integer tensor.
bool keeps_dtype(const Graph& g, const Node& node, const graph::OpFacts& facts, const graph::TensorMeta& written) {
  const bool floating = graph::is_floating_or_complex(written.dtype);
  if (facts.buffer_update == graph::OpBufferUpdate::kFloatingOnly && !floating) return false;
  bool same = true;
  for_each_tensor_arg(node, [&](ValueId id) { same = same && g.value(id).meta.dtype == written.dtype; });
  for (size_t i = 1; i < node.args.size(); ++i) {
    if (std::holds_alternative<std::complex<double>>(node.args[i])) return false;
    if (!floating && std::holds_alternative<double>(node.args[i])) return false;
  }
  return same;
}

}  // namespace

std::vector<BufferUpdate> functionalize_buffer_updates(Graph& g) {
  // Pass 1: which graph input each value shares storage with (through in-place results and views), the
  // candidate updates, and the inputs something else aliases or writes.
  std::map<ValueId, ValueId> storage_of;  // value -> the graph input whose storage it is
  std::map<ValueId, ValueId> version_of;  // input itself or an update's result -> the input (no views)
  for (ValueId id : g.inputs) {
    const graph::Value& v = g.value(id);
    if (v.meta.requires_grad || !is_dense_contiguous(v.meta)) continue;
    storage_of[id] = id;
    version_of[id] = id;
  }
  std::map<ValueId, int> view_made_at;  // a view of an input's storage -> the node that made it
  std::set<size_t> updates;       // node indices to rewrite
  std::set<ValueId> updated, aliased;  // by input
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node& node = g.nodes[n];
    const std::string name = node.qualified_name();
    const graph::OpFacts& facts = graph::op_facts(name);
    const auto* first = node.args.empty() ? nullptr : std::get_if<graph::TensorArg>(&node.args[0]);
    if (facts.buffer_update != graph::OpBufferUpdate::kNo && first && version_of.count(first->id) &&
        node.outputs.size() == 1) {
      const ValueId input = version_of.at(first->id);
      const graph::Value& result = g.value(node.outputs[0]);
      if (!result.meta.requires_grad && keeps_dtype(g, node, facts, g.value(input).meta)) {
        updates.insert(n);
        updated.insert(input);
        storage_of[node.outputs[0]] = version_of[node.outputs[0]] = input;
        continue;
      }
    }
    if (node.mutates_args || facts.mutates_only_buffers) {
      for_each_tensor_arg(node, [&](ValueId id) {
        if (auto it = storage_of.find(id); it != storage_of.end()) aliased.insert(it->second);
      });
    } else if (node.is_view) {
      for_each_tensor_arg(node, [&](ValueId id) {
        auto it = storage_of.find(id);
        if (it == storage_of.end()) return;
        for (ValueId out : node.outputs) {
          storage_of[out] = it->second;
          view_made_at[out] = static_cast<int>(n);
        }
      });
    }
  }
  // A view of an input is harmless when no update of that input falls between where it is made and its last read
  // (the views a slice write reads before its final copy_, passes/functionalize.cpp): it sees the values eager's
  // view sees. One read across an update would see the old values here, and a returned one must alias the input
  // itself (made after an update, it would view the update's fresh result): either way the input is left alone.
  std::vector<int> last_use(g.values.size(), -1);
  for (size_t n = 0; n < g.nodes.size(); ++n)
    for_each_tensor_arg(g.nodes[n], [&](ValueId id) { last_use[id] = static_cast<int>(n); });
  std::set<ValueId> returned(g.outputs.begin(), g.outputs.end());
  for (const auto& [view, made_at] : view_made_at) {
    const ValueId input = storage_of.at(view);
    const int read_until = std::max(made_at, last_use[view]);
    for (size_t n : updates)
      if (version_of.at(g.nodes[n].outputs[0]) == input &&
          (returned.count(view) || (made_at < static_cast<int>(n) && static_cast<int>(n) <= read_until)))
        aliased.insert(input);
  }

  // Pass 2: rewrite the updates of inputs nothing else aliases; readers take the latest version.
  std::map<ValueId, ValueId> latest;  // input -> its current value
  for (ValueId input : updated)
    if (!aliased.count(input)) latest[input] = input;
  auto current = [&](ValueId id) {
    auto version = version_of.find(id);
    if (version == version_of.end()) return id;
    auto it = latest.find(version->second);
    return it == latest.end() ? id : it->second;
  };
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    Node& node = g.nodes[n];
    for (graph::ArgValue& arg : node.args) graph::remap_tensors(arg, current);
    if (!updates.count(n)) continue;
    const ValueId input = version_of.at(node.outputs[0]);
    if (!latest.count(input)) continue;  // aliased: the in-place op stays (and is refused)
    std::tie(node.op, node.overload) = graph::split_qualified_name(graph::op_facts(node.qualified_name()).functional);
    node.mutates_args = false;
    graph::TensorMeta meta = g.value(input).meta;  // a fresh contiguous tensor like the input
    meta.strides = graph::contiguous_strides(meta.sizes);
    g.values[node.outputs[0]].meta = meta;
    latest[input] = node.outputs[0];
  }
  for (ValueId id : g.outputs) {
    auto version = version_of.find(id);
    if (version != version_of.end() && latest.count(version->second) && id != version->second)
      KILN_UNSUPPORTED() << "a graph output is an input updated in place (input " << g.value(version->second).input_index
                         << ")";
  }

  std::vector<BufferUpdate> result;
  for (ValueId input : g.inputs)
    if (latest.count(input) && latest.at(input) != input) result.push_back({g.value(input).input_index, latest.at(input)});
  return result;
}

}  // namespace kiln::passes
