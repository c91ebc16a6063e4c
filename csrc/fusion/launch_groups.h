#pragma once
/// Pointwise kernels that read only the graph's inputs and constants (a convolution weight relaid to
/// channels-last, the input image's copy) do not depend on anything the graph computes: they are moved to
/// the front of the schedule, to run as one launch (codegen/cuda emits them as one grouped kernel). ResNet-50
/// has 53 such weight copies of 4-40 us each, which the host launched one at a time between convolutions.
/// Torch-free.
#include <cstdint>
#include <vector>

#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::fusion {

/// Reorders `schedule.steps` so that such kernels come first, in their original order, and returns their
/// indices into schedule.kernels (empty when fewer than two qualify; then nothing moves). The group holds at
/// most `max_buffers` buffers in all (a kernel's parameter space is finite), and only kernels whose outputs
/// are at most 16 MiB, 64 MiB in all (each hoisted output is alive from the start).
std::vector<int32_t> hoist_input_kernels(Schedule& schedule, const graph::Graph& g, size_t max_buffers);

}  // namespace kiln::fusion
