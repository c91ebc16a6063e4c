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
/// `keep_peak`: also leave in place every kernel whose hoisting would raise the schedule's peak of live bytes
/// (live_bytes_per_step, inputs counted until their last use). A training step's backward starts at its peak,
/// with every saved activation alive (its inputs, released after their last use): there, a weight copy hoisted
/// from the first layer's gradient would add to the step's peak memory.
std::vector<int32_t> hoist_input_kernels(Schedule& schedule, const graph::Graph& g, size_t max_buffers,
                                         bool keep_peak = false);

/// Bytes of the values computed by the schedule (kernel stores, extern results) that are alive during each
/// step, in step order: from the step that makes a value to its last reader, to the end for graph outputs.
/// A view or an in-place result counts as the value it aliases. Constants are not counted; inputs only with
/// `count_inputs`, from the start to their last reader (the runtime drops its reference to an input there,
/// which frees a backward's saved activations).
std::vector<int64_t> live_bytes_per_step(const Schedule& schedule, const graph::Graph& g, bool count_inputs = false);

}  // namespace kiln::fusion
