#pragma once
// Running a graph cut into consecutive pieces (passes/split_at_parameter_buckets.h): each piece is a CompiledGraph of
// its own (a piece that needs grad is its own forward/backward pair behind its own autograd node), run in order on the
// values the caller passed and the earlier pieces made. Plain data in, no graph IR: compile/ says what feeds what.
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// One piece of a chain. Slots number the values of one run: the caller's inputs first, then each link's outputs,
/// link after link.
struct ChainLink {
  std::shared_ptr<CompiledGraph> graph;
  std::vector<int32_t> input_slots;  // per input of `graph`, the slot it reads
  size_t num_outputs = 0;            // outputs of `graph`, which take the next slots
};

/// A graph running `links` in order on `num_inputs` inputs and returning the slots `output_slots`. Each slot is
/// released after its last reader, so a boundary value lives no longer than the whole graph would keep it.
std::shared_ptr<CompiledGraph> make_chained_graph(std::vector<ChainLink> links, size_t num_inputs,
                                                  std::vector<int32_t> output_slots);

}  // namespace kiln::runtime
