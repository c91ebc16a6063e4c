// Packed gradients (see packed_outputs.h).
#include "runtime/packed_outputs.h"

#include <ATen/ops/empty.h>

#include <algorithm>

#include "common/log.h"
#include "runtime/node_call.h"

namespace kiln::runtime {
namespace {

using graph::ValueId;

constexpr int64_t kBucketBytes = 32ll << 20;
constexpr int64_t kAlignment = 512;  // the caching allocator's own granularity; vector loads need 16

// Dense and non-overlapping: the value fills numel * itemsize bytes from its start, whatever its dim order.
bool fills_its_bytes(const graph::TensorMeta& meta) {
  if (meta.storage_offset != 0) return false;
  std::vector<size_t> order(meta.sizes.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return meta.strides[a] < meta.strides[b]; });
  int64_t expected = 1;
  for (size_t d : order) {
    if (meta.sizes[d] == 1) continue;
    if (meta.strides[d] != expected) return false;
    expected *= meta.sizes[d];
  }
  return true;
}

int64_t numel_of(const graph::TensorMeta& meta) {
  int64_t n = 1;
  for (int64_t size : meta.sizes) n *= size;
  return n;
}

// The value output `v` shows the whole of, through views (itself when it is no such view).
ValueId whole_value_shown(const graph::Graph& g, ValueId v) {
  while (g.values[v].producer >= 0) {
    const graph::Node& node = g.nodes[g.values[v].producer];
    const auto* source = node.args.empty() ? nullptr : std::get_if<graph::TensorArg>(&node.args[0]);
    if (!node.is_view || node.op == "aten::reshape" || node.outputs.size() != 1 || !source ||
        g.values[v].meta.storage_offset != 0 || numel_of(g.values[source->id].meta) != numel_of(g.values[v].meta))
      break;
    v = source->id;
  }
  return v;
}

}  // namespace

PackPlan plan_packed_outputs(const graph::Graph& g, const std::vector<bool>& packed, const std::vector<MadeAt>& made,
                             size_t num_externs, const std::function<bool(int32_t external)>& writes_into) {
  PackPlan plan;
  plan.packed = packed;
  plan.bucket.assign(g.values.size(), -1);
  plan.offset.assign(g.values.size(), 0);
  plan.extern_into.assign(num_externs, false);
  std::vector<std::pair<int32_t, ValueId>> chosen;  // (plan position, value)
  std::vector<bool> taken(g.values.size(), false);
  for (size_t o = 0; o < g.outputs.size() && o < packed.size(); ++o) {
    if (!packed[o]) continue;
    const ValueId v = whole_value_shown(g, g.outputs[o]);
    const graph::Value& base = g.values[v];
    if (base.is_input || base.is_constant || made[v].position < 0 || taken[v] || !fills_its_bytes(base.meta)) continue;
    if (made[v].external >= 0) {
      if (!writes_into(made[v].external)) continue;
      plan.extern_into[made[v].external] = true;
    }
    taken[v] = true;
    chosen.emplace_back(made[v].position, v);
  }
  std::stable_sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  graph::Device bucket_device;
  for (const auto& [position, v] : chosen) {
    const graph::TensorMeta& meta = g.values[v].meta;
    int64_t bytes = numel_of(meta) * static_cast<int64_t>(c10::elementSize(static_cast<at::ScalarType>(meta.dtype)));
    bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (plan.bucket_bytes.empty() || plan.bucket_bytes.back() >= kBucketBytes || !(bucket_device == meta.device)) {
      plan.bucket_bytes.push_back(0);  // a bucket holds one device's values
      bucket_device = meta.device;
    }
    plan.bucket[v] = static_cast<int32_t>(plan.bucket_bytes.size()) - 1;
    plan.offset[v] = plan.bucket_bytes.back();
    plan.bucket_bytes.back() += bytes;
  }
  KILN_LOG(perf) << "kiln backward: " << chosen.size() << " leaf gradients in " << plan.bucket_bytes.size()
                 << " buckets";
  return plan;
}

at::Tensor packed_slot(const graph::Graph& g, const PackPlan& pack, std::vector<at::Tensor>& buckets, ValueId v) {
  const int32_t b = pack.bucket[v];
  const graph::TensorMeta& meta = g.values[v].meta;
  // The value's own device, not the graph's: a graph of extern calls only has no CUDA device of its own.
  const c10::Device device = to_c10(meta.device);
  if (!buckets[b].defined())
    buckets[b] = at::empty({pack.bucket_bytes[b]}, at::TensorOptions().dtype(at::kByte).device(device));
  const auto dtype = static_cast<at::ScalarType>(meta.dtype);
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype).device(device));
  t.set_(buckets[b].storage(), pack.offset[v] / static_cast<int64_t>(c10::elementSize(dtype)), meta.sizes, meta.strides);
  return t;
}

}  // namespace kiln::runtime
