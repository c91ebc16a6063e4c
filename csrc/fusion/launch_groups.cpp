// The input-only kernel group (fusion/launch_groups.h).
#include "fusion/launch_groups.h"

namespace kiln::fusion {

namespace {

// Hoisting a kernel keeps its outputs alive from the graph's start to their first use. Weight copies are
// small next to that; a backward's recomputation of a whole activation from saved inputs (relu(bn(x)) before a
// weight-gradient convolution) is not, and hoisting every layer's would hold all of them at once.
constexpr int64_t kMaxHoistedKernelBytes = int64_t{16} << 20;
constexpr int64_t kMaxHoistedBytes = int64_t{64} << 20;

int64_t output_bytes(const Kernel& k, const graph::Graph& g) {
  int64_t bytes = 0;
  for (const KernelBuffer& b : k.buffers)
    if (b.is_output) bytes += graph::nbytes(g.values[b.value].meta);
  return bytes;
}

bool reads_only_inputs(const Kernel& k, const graph::Graph& g) {
  if (k.has_reduction()) return false;
  for (const KernelBuffer& b : k.buffers)
    if (!b.is_output && g.values[b.value].producer >= 0) return false;
  return true;
}

}  // namespace

std::vector<int32_t> hoist_input_kernels(Schedule& schedule, const graph::Graph& g, size_t max_buffers) {
  std::vector<int32_t> group;
  std::vector<bool> hoisted(schedule.steps.size(), false);
  size_t buffers = 0;
  int64_t bytes = 0;
  for (size_t s = 0; s < schedule.steps.size(); ++s) {
    const Step& step = schedule.steps[s];
    if (step.kind != Step::Kind::Kernel) continue;
    const Kernel& k = schedule.kernels[step.index];
    if (!reads_only_inputs(k, g) || buffers + k.buffers.size() > max_buffers) continue;
    const int64_t kernel_bytes = output_bytes(k, g);
    if (kernel_bytes > kMaxHoistedKernelBytes || bytes + kernel_bytes > kMaxHoistedBytes) continue;
    bytes += kernel_bytes;
    buffers += k.buffers.size();
    group.push_back(step.index);
    hoisted[s] = true;
  }
  if (group.size() < 2) return {};
  std::vector<Step> steps;
  for (size_t s = 0; s < schedule.steps.size(); ++s)
    if (hoisted[s]) steps.push_back(schedule.steps[s]);
  for (size_t s = 0; s < schedule.steps.size(); ++s)
    if (!hoisted[s]) steps.push_back(schedule.steps[s]);
  schedule.steps = std::move(steps);
  return group;
}

}  // namespace kiln::fusion
