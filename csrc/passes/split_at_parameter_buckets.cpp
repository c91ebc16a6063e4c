// split_at_parameter_buckets (see the header): where the cuts go, where they may go, and the pieces built around them.
//
// Design: three linear walks. The cuts DDP's buckets ask for come from a reverse walk over the bytes of parameters
// at their first reader. Which positions may take a cut comes from intervals over the node list: a view or in-place
// result may not cross a cut (the piece after would read a copy where eager reads an alias), and no cut may fall
// between a node that makes storage and a later node that writes to it (the write would land in a piece's input,
// which the compiled piece does not own). The pieces are then copied out node by node, each reading the slots of
// the values it needs and writing the values later pieces or the graph's outputs read.
#include "passes/split_at_parameter_buckets.h"

#include <algorithm>

#include "common/error.h"

namespace kiln::passes {

namespace {

using graph::Graph;
using graph::Node;
using graph::ValueId;

// Per value: the first and the last node that reads it (the last is the node count for a graph output); -1 when none.
struct Readers {
  std::vector<int32_t> first;
  std::vector<int32_t> last;
};

Readers readers_of(const Graph& g) {
  Readers r;
  r.first.assign(g.values.size(), -1);
  r.last.assign(g.values.size(), -1);
  for (size_t k = 0; k < g.nodes.size(); ++k)
    for (const graph::ArgValue& arg : g.nodes[k].args)
      graph::for_each_tensor(arg, [&](ValueId id) {
        if (r.first[id] < 0) r.first[id] = static_cast<int32_t>(k);
        r.last[id] = static_cast<int32_t>(k);
      });
  for (ValueId out : g.outputs) r.last[out] = static_cast<int32_t>(g.nodes.size());
  return r;
}

// Cut positions c (a cut before node c, 1 <= c < node count) where DDP's buckets close, in increasing order: walking
// the nodes backward, a piece closes once the parameters first read in it reach its bucket's cap.
std::vector<int32_t> bucket_cuts(const std::vector<int64_t>& bytes_at, const ParameterBuckets& buckets) {
  std::vector<int32_t> cuts;
  int64_t held = 0;
  int64_t cap = buckets.first_bucket_bytes > 0 ? buckets.first_bucket_bytes : buckets.bucket_bytes;
  const auto n = static_cast<int32_t>(bytes_at.size());
  for (int32_t k = n - 1; k >= 0; --k) {
    if (held >= cap && k + 1 < n) {
      cuts.push_back(k + 1);
      held = 0;
      cap = buckets.bucket_bytes;
    }
    held += bytes_at[k];
  }
  // The nodes before the last cut made form the first piece; without parameters of their own they stay with the next.
  if (!cuts.empty() && held == 0) cuts.pop_back();
  std::reverse(cuts.begin(), cuts.end());
  return cuts;
}

// allowed[c]: a cut before node c keeps every alias with its base (see the design note).
std::vector<bool> allowed_cuts(const Graph& g, const Readers& readers) {
  const auto n = static_cast<int32_t>(g.nodes.size());
  std::vector<int32_t> blocked(n + 2, 0);  // a difference array over positions
  auto block = [&](int32_t from, int32_t to) {  // positions from..to inclusive
    from = std::max(from, 1);
    to = std::min(to, n - 1);
    if (from > to) return;
    blocked[from]++;
    blocked[to + 1]--;
  };
  const std::vector<ValueId> roots = graph::storage_roots(g);
  for (const graph::Value& v : g.values)
    if (v.producer >= 0 && roots[v.id] != v.id && readers.last[v.id] > v.producer)
      block(v.producer + 1, readers.last[v.id]);  // an alias read after a cut would cross it
  for (int32_t k = 0; k < n; ++k) {
    const Node& node = g.nodes[k];
    if (!node.mutates_args) continue;
    ValueId base = -1;
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](ValueId id) {
        if (base < 0) base = roots[id];
      });
    // A write to an input (a buffer update) is made by whichever piece holds it, as the whole graph makes it.
    if (base >= 0 && g.values[base].producer >= 0) block(g.values[base].producer + 1, k);
  }
  std::vector<bool> allowed(n + 1, false);
  int32_t depth = 0;
  for (int32_t c = 0; c <= n; ++c) {
    depth += blocked[c];
    allowed[c] = c >= 1 && c < n && depth == 0;
  }
  return allowed;
}

// The wanted cuts moved to the nearest allowed position between their neighbours, or dropped when none is.
std::vector<int32_t> place_cuts(const std::vector<int32_t>& wanted, const std::vector<bool>& allowed, int32_t n) {
  std::vector<int32_t> placed;
  for (size_t i = 0; i < wanted.size(); ++i) {
    const int32_t low = placed.empty() ? 0 : placed.back();  // exclusive bounds
    const int32_t high = i + 1 < wanted.size() ? wanted[i + 1] : n;
    for (int32_t d = 0; wanted[i] - d > low || wanted[i] + d < high; ++d) {
      if (const int32_t left = wanted[i] - d; left > low && left < high && allowed[left]) {
        placed.push_back(left);
        break;
      }
      if (const int32_t right = wanted[i] + d; right > low && right < high && allowed[right]) {
        placed.push_back(right);
        break;
      }
    }
  }
  return placed;
}

// Copies nodes [begin, end) of `g` into a piece. `slot_of` gives the slot of every value an earlier piece or the
// caller provides and receives the slots of this piece's outputs, numbered from `next_slot`. The last piece also
// writes the graph outputs that are constants.
GraphPiece make_piece(const Graph& g, const Readers& readers, int32_t begin, int32_t end, bool last,
                      std::vector<int32_t>& slot_of, int32_t& next_slot) {
  GraphPiece piece;
  piece.graph = std::make_shared<Graph>();
  Graph& p = *piece.graph;
  std::vector<ValueId> local(g.values.size(), -1);
  auto local_of = [&](ValueId id) -> ValueId {
    if (local[id] >= 0) return local[id];
    const graph::Value& v = g.values[id];
    if (v.is_constant) {
      local[id] = p.add_constant(v.meta, v.constant);
    } else {
      KILN_ASSERT(slot_of[id] >= 0) << "value %" << id << " is read before a piece makes it";
      local[id] = p.add_input(v.meta);
      piece.input_slots.push_back(slot_of[id]);
    }
    return local[id];
  };
  for (int32_t k = begin; k < end; ++k) {
    Node node = g.nodes[k];
    for (graph::ArgValue& arg : node.args) graph::remap_tensors(arg, local_of);
    std::vector<graph::TensorMeta> metas;
    for (ValueId out : g.nodes[k].outputs) metas.push_back(g.values[out].meta);
    const std::vector<ValueId> made = p.add_node(std::move(node), std::move(metas));
    for (size_t i = 0; i < made.size(); ++i) local[g.nodes[k].outputs[i]] = made[i];
  }
  std::vector<ValueId> outputs;
  for (const graph::Value& v : g.values) {
    const bool made_here = v.producer >= begin && v.producer < end;
    const bool constant_output = last && v.is_constant && readers.last[v.id] == static_cast<int32_t>(g.nodes.size());
    if ((made_here && readers.last[v.id] >= end) || constant_output) {
      outputs.push_back(local_of(v.id));
      slot_of[v.id] = next_slot++;
    }
  }
  p.set_outputs(std::move(outputs));
  return piece;
}

}  // namespace

SplitGraph split_at_parameter_buckets(const Graph& g, const ParameterBuckets& buckets) {
  const auto n = static_cast<int32_t>(g.nodes.size());
  if (n < 2 || buckets.bucket_bytes <= 0 || buckets.parameter_inputs.empty()) return {};
  const Readers readers = readers_of(g);
  std::vector<int64_t> bytes_at(n, 0);
  for (int32_t input : buckets.parameter_inputs) {
    KILN_ASSERT(input >= 0 && static_cast<size_t>(input) < g.inputs.size()) << "parameter input " << input;
    const ValueId id = g.inputs[input];
    if (readers.first[id] >= 0) bytes_at[readers.first[id]] += graph::nbytes(g.values[id].meta);
  }
  const std::vector<int32_t> cuts = place_cuts(bucket_cuts(bytes_at, buckets), allowed_cuts(g, readers), n);
  if (cuts.empty()) return {};
  SplitGraph split;
  std::vector<int32_t> slot_of(g.values.size(), -1);
  for (ValueId id : g.inputs) slot_of[id] = g.values[id].input_index;
  int32_t next_slot = static_cast<int32_t>(g.inputs.size());
  int32_t begin = 0;
  for (size_t i = 0; i <= cuts.size(); ++i) {
    const int32_t end = i < cuts.size() ? cuts[i] : n;
    GraphPiece piece = make_piece(g, readers, begin, end, i == cuts.size(), slot_of, next_slot);
    for (int32_t k = begin; k < end; ++k) piece.parameter_bytes += bytes_at[k];
    split.pieces.push_back(std::move(piece));
    begin = end;
  }
  for (ValueId out : g.outputs) {
    KILN_ASSERT(slot_of[out] >= 0) << "graph output %" << out << " is made by no piece";
    split.output_slots.push_back(slot_of[out]);
  }
  return split;
}

}  // namespace kiln::passes
