#pragma once
// Where a backward graph writes the gradients AccumulateGrad keeps (CompiledGraph::run_packing): side by side in
// buckets of about 32 MB, each one caching-allocator block taken when its first gradient is made. One block per
// gradient costs each up to 1 MB of rounding, since the allocator hands out a cached block whole when what would
// be left of it is under 1 MB; a bucket costs that once (BERT-base: 200 gradients, 23 MB of rounding held through
// the optimizer step). The gradients share their bucket's storage until the last of them is freed, as torch's DDP
// gradient buckets do. CPU graphs pack too (the same code path, tested without a GPU).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "graph/graph.h"

namespace kiln::runtime {

struct PackPlan {
  std::vector<bool> packed;           // the run_packing mask it was built for
  std::vector<int32_t> bucket;        // per value: its bucket, or -1 when allocated on its own
  std::vector<int64_t> offset;        // per value: its byte offset in the bucket
  std::vector<int64_t> bucket_bytes;  // per bucket
  std::vector<bool> extern_into;      // per extern call: run its out= overload into the packed outputs
};

/// Where a value of the run plan is made: the plan position of its step, and the extern call's index when an
/// extern op makes it (-1 for a kernel's output, and for values no step makes).
struct MadeAt {
  int32_t position = -1;
  int32_t external = -1;
};

/// The buckets for the outputs of `g` that `packed` marks. A packed output is placed where it is made: a
/// kernel's output, or an extern op's when `writes_into(external)` says it can write into a given tensor (its
/// out= overload). An output that is a view of the whole of such a value (t(mm(...)), a view of a sum) places that
/// value. Anything else (a graph input, a partial view, an op without an out= overload) is allocated as before.
/// Buckets follow the order values are made in; a bucket holds one device's values.
PackPlan plan_packed_outputs(const graph::Graph& g, const std::vector<bool>& packed, const std::vector<MadeAt>& made,
                             size_t num_externs, const std::function<bool(int32_t external)>& writes_into);

/// Value `v`'s tensor: its place in its bucket, the bucket allocated (on the device of its values) when the first
/// of them is made.
at::Tensor packed_slot(const graph::Graph& g, const PackPlan& pack, std::vector<at::Tensor>& buckets,
                       graph::ValueId v);

}  // namespace kiln::runtime
