// Channels-last layout for CUDA convolution chains (passes/channels_last.h).
//
// Design: one walk over the nodes in order, knowing for each value whether it now lives in channels-last
// layout ("relaid"). A convolution that qualifies gets its input and weight relaid (a clone node each,
// unless the input already is) and produces a relaid output. Ops that keep a channels-last input's layout in
// eager (pointwise ops, batch norm, max pooling: the op table's OpLayout) pass it on when all their operands shaped
// like the output are relaid (broadcast operands, like a [C, 1, 1] scale, do not decide the layout). Anything else, and the
// graph's outputs, get the value back in its recorded layout (one clone per value, made on first need), so
// the graph's observable strides, views and aliasing are the recorded ones. New metas are derived, not
// traced: relaid values keep their sizes and take channels-last strides, which is what ATen's CUDA kernels
// return for such inputs (and runtime/kernel_graph.cpp copies any extern result that disagrees with its meta
// before a kernel reads it).
#include "passes/channels_last.h"

#include "graph/op_facts.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::OpLayout;
using graph::ScalarType;
using graph::TensorArg;
using graph::ValueId;

namespace {

constexpr int8_t kContiguousFormat = 0;    // c10::MemoryFormat::Contiguous
constexpr int8_t kChannelsLastFormat = 2;  // c10::MemoryFormat::ChannelsLast
constexpr int64_t kMinChannels = 16;       // below this (an RGB stem) NHWC gains nothing and costs a copy

// True when some dim of size > 1 has stride 0 (an expanded operand).
bool broadcast(const graph::TensorMeta& m) {
  for (size_t d = 0; d < m.sizes.size(); ++d)
    if (m.sizes[d] > 1 && m.strides[d] == 0) return true;
  return false;
}

std::vector<int64_t> channels_last_strides(const std::vector<int64_t>& sizes) {
  const int64_t c = sizes[1], h = sizes[2], w = sizes[3];
  return {c * h * w, 1, w * c, c};
}

// True when `m` is laid out channels-last already, strides of size-1 dims aside (ATen's contiguity test
// ignores them too): a 1x1 convolution's [K, C, 1, 1] weight in the default layout is one, and ATen's
// convolution takes it as it is, so copying it would only cost (36 of ResNet-50's 53 weights).
bool already_channels_last(const graph::TensorMeta& m) {
  const std::vector<int64_t> wanted = channels_last_strides(m.sizes);
  for (size_t d = 0; d < 4; ++d)
    if (m.sizes[d] > 1 && m.strides[d] != wanted[d]) return false;
  return true;
}

bool floating_cuda_4d(const graph::TensorMeta& m) {
  return m.sizes.size() == 4 && m.device.type == graph::DeviceType::CUDA &&
         (m.dtype == ScalarType::Float || m.dtype == ScalarType::Half || m.dtype == ScalarType::BFloat16);
}

bool float_cpu_4d(const graph::TensorMeta& m) {
  return m.sizes.size() == 4 && m.device.type == graph::DeviceType::CPU && m.dtype == ScalarType::Float;
}

// A convolution that runs channels-last. On CUDA, one with a narrow input (an RGB stem) only qualifies as
// `stem`, when the graph has wider ones: relaying its input then costs one small copy and saves cuDNN's own
// layout conversions around it and the restore before the chain (resnet50: 250 us per call on an H200); alone,
// as in conv + ReLU, NHWC gains nothing and costs two copies. On CPU every float32 one qualifies: oneDNN's
// NHWC kernels beat its NCHW path at every shape measured on a 2-core x86 host, most for narrow inputs (an RGB
// 3x3 convolution on 224x224: 0.61 ms against 6.3 ms; a 1x1 64->256 on 8x56x56: 5.2 against 22.8 ms).
bool qualifies(const Graph& g, const Node& node, bool stem, bool cpu) {
  if (node.qualified_name() != "aten::convolution.default" || node.args.size() < 9) return false;
  const auto* input = std::get_if<TensorArg>(&node.args[0]);
  const auto* weight = std::get_if<TensorArg>(&node.args[1]);
  const bool* transposed = std::get_if<bool>(&node.args[6]);
  if (!input || !weight || !transposed || *transposed) return false;
  const auto& in = g.values[input->id].meta;
  const auto& w = g.values[weight->id].meta;
  if (w.sizes.size() != 4) return false;
  if (float_cpu_4d(in)) return cpu;
  return floating_cuda_4d(in) && (stem || in.sizes[1] >= kMinChannels) && w.sizes[0] >= kMinChannels;
}

// The op table's layout, and a dtype cast (`_to_copy` with neither a device nor a memory format: autocast's casts,
// and the one lowered 16-bit batch norm ends with) keeps its operand's layout like any pointwise op.
OpLayout layout_of(const Node& node) {
  if (node.qualified_name() == "aten::_to_copy.default" && node.args.size() == 7 &&
      std::holds_alternative<graph::NoneArg>(node.args[3]) && std::holds_alternative<graph::NoneArg>(node.args[6]))
    return OpLayout::kFollowsOperands;
  return graph::op_facts(node.qualified_name()).layout;
}

class Relayout {
 public:
  Relayout(Graph& g, bool stems, bool cpu)
      : g_(g),
        rewriter_(g),
        stems_(stems),
        cpu_(cpu),
        relaid_(g.values.size(), false),
        neutral_(g.values.size(), false),
        restored_(g.values.size(), -1) {
    for (const graph::Value& v : g.values) recorded_strides_.push_back(v.meta.strides);
  }

  void run() {
    for (Node& node : rewriter_.take_nodes()) {
      const OpLayout layout = layout_of(node);
      if (qualifies(g_, node, stems_, cpu_)) {
        for (int a : {0, 1}) {
          ValueId& id = std::get<TensorArg>(node.args[a]).id;
          if (!relaid_[id] && !already_channels_last(g_.values[id].meta)) id = clone(id, kChannelsLastFormat);
        }
        set_relaid(node.outputs[0]);
      } else if (follows(node, layout)) {
        if (layout == OpLayout::kBatchNorm) set_relaid(node.outputs[0]);
        else
          for (ValueId out : node.outputs) set_relaid(out);
      } else if (only_broadcast_operands(node, layout)) {
        for (ValueId out : node.outputs) neutral_[out] = true;
      } else {
        restore_args(node);
      }
      rewriter_.append(std::move(node));
    }
    for (ValueId& out : g_.outputs)
      if (out < static_cast<ValueId>(relaid_.size()) && relaid_[out]) out = restored(out);
  }

  bool changed() const { return changed_; }

 private:
  // A pointwise op over broadcast (or broadcast-derived) operands only, like `rsqrt(var + eps)` expanded
  // from a per-channel vector: its output has no layout of its own to keep, and it does not break a chain.
  bool only_broadcast_operands(const Node& node, OpLayout layout) const {
    if (layout != OpLayout::kFollowsOperands || node.outputs.size() != 1) return false;
    bool any = false;
    for (const ArgValue& arg : node.args) {
      const auto* t = std::get_if<TensorArg>(&arg);
      if (!t) continue;
      if (!neutral(t->id)) return false;
      any = true;
    }
    return any;
  }

  bool neutral(ValueId id) const { return neutral_[id] || broadcast(g_.values[id].meta); }

  // True when every 4-d tensor operand is relaid and at least one is (so the op keeps the layout).
  bool follows(const Node& node, OpLayout layout) const {
    if (layout == OpLayout::kFollowsFirstOperand) {
      const auto* input = std::get_if<TensorArg>(&node.args[0]);
      if (!input || !relaid_[input->id]) return false;
      for (ValueId out : node.outputs)
        if (g_.values[out].meta.sizes.size() != 4) return false;
      return true;
    }
    const bool batch_norm = layout == OpLayout::kBatchNorm;
    if (layout != OpLayout::kFollowsOperands && !batch_norm) return false;
    bool any = false, all = true;
    for (size_t a = 0; a < node.args.size(); ++a) {
      const auto* t = std::get_if<TensorArg>(&node.args[a]);
      if (!t) continue;
      const auto& meta = g_.values[t->id].meta;
      if (batch_norm && a > 0) continue;  // weight, bias, running stats: vectors
      // Operands shaped like the output decide its layout; broadcast ones (a [C, 1, 1] scale, or one expanded
      // with stride 0) do not.
      if (meta.sizes.size() == 4 && meta.sizes == g_.values[node.outputs[0]].meta.sizes && !neutral(t->id)) {
        any = any || relaid_[t->id];
        all = all && relaid_[t->id];
      } else if (meta.sizes.size() == 4 && relaid_[t->id]) {
        all = false;
      }
    }
    if (!any || !all) return false;
    for (ValueId out : node.outputs)
      if (!batch_norm && g_.values[out].meta.sizes.size() != 4) return false;
    return true;
  }

  void restore_args(Node& node) {
    for (ArgValue& arg : node.args)
      graph::remap_tensors(arg, [&](ValueId id) { return relaid_[id] ? restored(id) : id; });
  }

  void set_relaid(ValueId id) {
    auto& meta = g_.values[id].meta;
    if (meta.sizes.size() != 4) return;
    meta.strides = channels_last_strides(meta.sizes);
    relaid_[id] = true;
    changed_ = true;
  }

  // The value in its recorded layout: one clone per relaid value, made on first need. A value recorded
  // channels-last already (a forward half whose captured graph was relaid before autodiff) needs none.
  ValueId restored(ValueId id) {
    if (id < static_cast<ValueId>(recorded_strides_.size()) && g_.values[id].meta.strides == recorded_strides_[id])
      return id;
    if (restored_[id] < 0) restored_[id] = clone(id, kContiguousFormat);
    return restored_[id];
  }

  // Appends `clone(id, memory_format=format)` and returns its output, laid out as asked.
  ValueId clone(ValueId id, int8_t format) {
    graph::TensorMeta meta = g_.values[id].meta;
    meta.storage_offset = 0;  // requires_grad stays: the joint builder differentiates through the clone
    meta.strides =
        format == kChannelsLastFormat ? channels_last_strides(meta.sizes) : graph::contiguous_strides(meta.sizes);
    const ValueId copy = rewriter_.add("aten::clone", "default", {TensorArg{id}, graph::MemoryFormatArg{format}},
                                       {"self", "memory_format"}, 1, meta);
    relaid_.push_back(format == kChannelsLastFormat);
    neutral_.push_back(false);
    restored_.push_back(-1);
    changed_ = true;
    return copy;
  }

  Graph& g_;
  GraphRewriter rewriter_;
  const bool stems_;
  const bool cpu_;
  std::vector<bool> relaid_;
  std::vector<bool> neutral_;  // computed from broadcast operands only (see only_broadcast_operands)
  std::vector<ValueId> restored_;
  std::vector<std::vector<int64_t>> recorded_strides_;  // per value of the graph as it came
  bool changed_ = false;
};

}  // namespace

bool relayout_convolutions_channels_last(Graph& g, bool cpu) {
  bool any = false;
  for (const Node& node : g.nodes) any = any || qualifies(g, node, /*stem=*/false, cpu);
  if (!any) return false;
  Relayout relayout(g, /*stems=*/true, cpu);
  relayout.run();
  return relayout.changed();
}

}  // namespace kiln::passes
