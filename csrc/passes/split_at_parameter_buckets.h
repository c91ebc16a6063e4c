#pragma once
// Splitting a training graph at the gradient buckets of a data-parallel wrapper (torch's DistributedDataParallel).
// DDP all-reduces gradients bucket by bucket, each bucket as soon as its last gradient reaches AccumulateGrad. A graph
// compiled whole is one autograd node: every gradient arrives when its whole backward is done, and no all-reduce
// overlaps it. Cut into consecutive pieces holding about one bucket's worth of parameters each, the graph compiles as
// one forward/backward pair per piece (one autograd node each), and the gradients of the last piece's parameters, the
// first bucket, are reduced while the earlier pieces' backwards still run. Torch-free: runtime/chained_graph.h runs
// the pieces.
#include <cstdint>
#include <memory>
#include <vector>

#include "graph/graph.h"

namespace kiln::passes {

/// Which graph inputs are parameters the wrapper reduces in buckets (those that require grad), and its bucket sizes.
struct ParameterBuckets {
  std::vector<int32_t> parameter_inputs;  // graph input indices
  int64_t bucket_bytes = 0;               // DDP's bucket_bytes_cap
  int64_t first_bucket_bytes = 0;         // the first bucket's cap: the parameters used last in the forward
};

/// One piece of a split graph. Slots number the values that flow between pieces: the original graph's inputs first
/// (slot i is input i), then each piece's outputs, piece after piece, in order.
struct GraphPiece {
  std::shared_ptr<graph::Graph> graph;
  std::vector<int32_t> input_slots;  // per input of `graph`, the slot it reads
  int64_t parameter_bytes = 0;       // bytes of the parameters first used in this piece
};

struct SplitGraph {
  std::vector<GraphPiece> pieces;     // in execution order; empty when the graph stays whole
  std::vector<int32_t> output_slots;  // per output of the original graph, the slot that holds it
};

/// Needs: a verified graph whose nodes are in execution order. Walks the nodes from the last to the first, counting
/// the bytes of each parameter at the node that reads it first, and closes a piece once it holds at least one
/// bucket's worth (the first piece closed, the last of the forward, at `first_bucket_bytes`), as DDP closes its
/// buckets in the order the backward makes the gradients. Guarantees: running the pieces in order, each on the slots
/// it reads, gives the original graph's outputs; values only flow forward; no cut separates a view or an in-place
/// result from its base (a value crossing a cut is its own storage, and no piece writes to storage an earlier piece
/// made): a cut that would is moved to the nearest position that does not, or dropped. Returns no pieces when fewer
/// than two remain.
SplitGraph split_at_parameter_buckets(const graph::Graph& g, const ParameterBuckets& buckets);

}  // namespace kiln::passes
