// The input-only kernel group (fusion/launch_groups.h).
#include "fusion/launch_groups.h"

#include <algorithm>

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

std::vector<int64_t> live_bytes_per_step(const Schedule& schedule, const graph::Graph& g, bool count_inputs) {
  const size_t num_values = g.values.size();
  const int num_steps = static_cast<int>(schedule.steps.size());
  const std::vector<graph::ValueId> root = graph::storage_roots(g);
  std::vector<int> birth(num_values, -1), death(num_values, -1);
  auto counted = [&](graph::ValueId r) {
    return g.values[r].producer >= 0 || (count_inputs && g.values[r].is_input);
  };
  auto touch = [&](graph::ValueId v, int s, bool makes) {
    const graph::ValueId r = root[v];
    if (!counted(r)) return;  // a constant, or an input when inputs are not counted (or a view of one)
    if (g.values[r].is_input) birth[r] = 0;
    if (makes && birth[r] < 0) birth[r] = s;
    death[r] = std::max(death[r], s);
  };
  for (int s = 0; s < num_steps; ++s) {
    const Step& step = schedule.steps[s];
    if (step.kind == Step::Kind::Kernel) {
      for (const KernelBuffer& b : schedule.kernels[step.index].buffers) touch(b.value, s, b.is_output);
    } else {
      const graph::Node& node = g.nodes[step.index];
      for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](graph::ValueId id) { touch(id, s, false); });
      for (graph::ValueId out : node.outputs) touch(out, s, true);
    }
  }
  for (graph::ValueId out : g.outputs)
    if (counted(root[out]) && birth[root[out]] >= 0) death[root[out]] = num_steps - 1;
  std::vector<int64_t> change(static_cast<size_t>(num_steps) + 1, 0);
  for (size_t v = 0; v < num_values; ++v) {
    if (root[v] != static_cast<graph::ValueId>(v) || birth[v] < 0) continue;
    const int64_t bytes = graph::nbytes(g.values[v].meta);
    change[birth[v]] += bytes;
    change[death[v] + 1] -= bytes;
  }
  std::vector<int64_t> live(num_steps);
  int64_t running = 0;
  for (int s = 0; s < num_steps; ++s) live[s] = running += change[s];
  return live;
}

std::vector<int32_t> hoist_input_kernels(Schedule& schedule, const graph::Graph& g, size_t max_buffers,
                                         bool keep_peak) {
  std::vector<int32_t> group;
  std::vector<bool> hoisted(schedule.steps.size(), false);
  std::vector<int64_t> live;
  int64_t peak = 0;
  if (keep_peak) {
    live = live_bytes_per_step(schedule, g, /*count_inputs=*/true);
    for (int64_t bytes : live) peak = std::max(peak, bytes);
  }
  size_t buffers = 0;
  int64_t bytes = 0;
  for (size_t s = 0; s < schedule.steps.size(); ++s) {
    const Step& step = schedule.steps[s];
    if (step.kind != Step::Kind::Kernel) continue;
    const Kernel& k = schedule.kernels[step.index];
    if (!reads_only_inputs(k, g) || buffers + k.buffers.size() > max_buffers) continue;
    const int64_t kernel_bytes = output_bytes(k, g);
    if (kernel_bytes > kMaxHoistedKernelBytes || bytes + kernel_bytes > kMaxHoistedBytes) continue;
    if (keep_peak) {  // hoisted, its outputs are alive from the start instead of from step s
      int64_t before = 0;
      for (size_t i = 0; i < s; ++i) before = std::max(before, live[i]);
      if (before + kernel_bytes > peak) continue;
      for (size_t i = 0; i < s; ++i) live[i] += kernel_bytes;
    }
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
