// scaled_dot_product_attention as a differentiable kernel (passes/lower_attention.h).
#include "passes/lower_attention.h"

#include <limits>
#include <map>
#include <utility>
#include <optional>
#include <variant>

#include "common/error.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

namespace {

using graph::ArgValue;
using graph::ScalarType;
using graph::TensorArg;
using graph::ValueId;
using graph::tensor_meta;

// The memory-efficient kernels read the bias through its strides, each a multiple of this many elements (the
// CUTLASS kernels' alignment for any dtype: 16 bytes of float32 is 4, of 16-bit is 8; ATen pads to 16).
constexpr int64_t kBiasAlignment = 16;

double number(const ArgValue& arg, double fallback) {
  if (const auto* d = std::get_if<double>(&arg)) return *d;
  if (const auto* i = std::get_if<int64_t>(&arg)) return static_cast<double>(*i);
  return fallback;
}

bool flag(const ArgValue& arg) {
  const auto* b = std::get_if<bool>(&arg);
  return b && *b;
}

// Dense (batch, heads, length, head_dim) query/key/value of one floating dtype, unit stride in head_dim, the
// same batch and heads (no broadcasting), head_dim a multiple of 8 up to 256: what both kernels accept.
bool kernel_accepts(const graph::TensorMeta& q, const graph::TensorMeta& k, const graph::TensorMeta& v) {
  for (const graph::TensorMeta* m : {&q, &k, &v}) {
    if (m->sizes.size() != 4 || m->strides[3] != 1 || m->dtype != q.dtype || !(m->device == q.device)) return false;
    if (m->sizes[0] != q.sizes[0] || m->sizes[1] != q.sizes[1] || m->sizes[2] == 0) return false;
  }
  const bool floating = q.dtype == ScalarType::Float || q.dtype == ScalarType::Half || q.dtype == ScalarType::BFloat16;
  const int64_t head_dim = q.sizes[3];
  return floating && k.sizes[3] == head_dim && v.sizes[3] == head_dim && k.sizes[2] == v.sizes[2] && head_dim % 8 == 0 &&
         head_dim <= 256;
}

// A mask the kernels take as an additive bias: boolean (True keeps) or of the query's dtype, not needing grad,
// broadcasting to the scores' (batch, heads, length, key length).
bool mask_accepted(const graph::TensorMeta& mask, const graph::TensorMeta& q, const graph::TensorMeta& k) {
  if (mask.requires_grad || !(mask.device == q.device) || mask.sizes.size() > 4) return false;
  if (mask.dtype != ScalarType::Bool && mask.dtype != q.dtype) return false;
  const std::vector<int64_t> scores = {q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
  const size_t lead = 4 - mask.sizes.size();
  for (size_t d = 0; d < mask.sizes.size(); ++d)
    if (mask.sizes[d] != 1 && mask.sizes[d] != scores[lead + d]) return false;
  return true;
}

// Strides the memory-efficient kernels accept for a (batch, heads, length, key length) bias: unit stride in the key
// dim, the others (0 where broadcast) multiples of kBiasAlignment, and an aligned start.
bool bias_aligned(const graph::TensorMeta& bias) {
  if (bias.storage_offset % kBiasAlignment != 0 || bias.strides[3] != 1) return false;
  for (size_t d = 0; d < 3; ++d)
    if (bias.sizes[d] > 1 && bias.strides[d] % kBiasAlignment != 0) return false;
  return true;
}

// The mask as the kernels' bias, (batch, heads, length, key length) of the query's dtype: eager's conversion of a
// boolean mask (0 where True, -inf where False), broadcast; for the memory-efficient kernels, a bias whose strides
// they cannot read is first written into rows padded to kBiasAlignment and viewed back (ATen pads it the same way).
// nullopt when the bias built is still not aligned (a layout the pad's meta kernel did not make dense): the nodes
// added are then dead, and the attention is left alone.
std::optional<ValueId> attention_bias(GraphRewriter& rewriter, graph::OpOracle& oracle, ValueId mask,
                                      const graph::TensorMeta& q, const graph::TensorMeta& k, bool align) {
  graph::Graph& g = rewriter.graph();
  ValueId bias = mask;
  if (g.value(mask).meta.dtype == ScalarType::Bool) {
    const ValueId dropped = rewriter.add_completed(oracle, "aten::logical_not", "default", {TensorArg{mask}});
    const ValueId ones = rewriter.cast(dropped, q.dtype);  // 1 where dropped: then filled with -inf, the rest 0
    bias = rewriter.add_completed(oracle, "aten::masked_fill", "Scalar",
                                  {TensorArg{ones}, TensorArg{dropped}, -std::numeric_limits<double>::infinity()});
  }
  const std::vector<int64_t> scores = {q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
  graph::TensorMeta expanded = g.value(bias).meta;
  expanded.strides = graph::broadcast_strides(expanded, scores);
  expanded.sizes = scores;
  if (align && !bias_aligned(expanded)) {
    const int64_t length = scores[3];
    const std::vector<int64_t>& sizes = g.value(bias).meta.sizes;
    if (sizes.empty() || sizes.back() != length) bias = rewriter.expand(bias, scores);  // the key dim broadcast
    // As ATen's pad_bias: 1 to kBiasAlignment columns, so the padded rows' stride is a multiple of it.
    const int64_t pad = kBiasAlignment - length % kBiasAlignment;
    const ValueId padded = rewriter.add_completed(oracle, "aten::constant_pad_nd", "default",
                                                  {TensorArg{bias}, std::vector<int64_t>{0, pad}, 0.0});
    bias = rewriter.add_completed(oracle, "aten::slice", "Tensor",
                                  {TensorArg{padded}, int64_t{-1}, int64_t{0}, length, int64_t{1}});
  }
  bias = rewriter.expand(bias, scores);
  if (align && !bias_aligned(g.value(bias).meta)) return std::nullopt;
  return bias;
}

}  // namespace

void lower_attention_for_autodiff(graph::Graph& g, graph::OpOracle& oracle) {
  GraphRewriter rewriter(g);
  std::vector<graph::Node> nodes = rewriter.take_nodes();
  for (graph::Node& node : nodes) {
    if (node.qualified_name() != "aten::scaled_dot_product_attention.default") {
      rewriter.append(std::move(node));
      continue;
    }
    // (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    const std::vector<ArgValue>& a = node.args;
    const graph::TensorMeta* q = tensor_meta(g, a.at(0));
    const graph::TensorMeta* k = tensor_meta(g, a.at(1));
    const graph::TensorMeta* v = tensor_meta(g, a.at(2));
    const graph::TensorMeta* mask = tensor_meta(g, a.at(3));
    const bool causal = flag(a.at(5));
    const double dropout = number(a.at(4), 0.0);
    const bool cuda = q && q->device.type == graph::DeviceType::CUDA;
    const bool cpu = q && q->device.type == graph::DeviceType::CPU;
    // ATen refuses a mask together with is_causal; CPU flash attention has no dropout.
    const bool accepted = q && k && v && !flag(a.at(7)) && kernel_accepts(*q, *k, *v) &&
                          (!mask || (!causal && mask_accepted(*mask, *q, *k))) && (cuda || (cpu && dropout == 0.0));
    if (!accepted) {
      rewriter.append(std::move(node));
      continue;
    }
    const graph::TensorMeta query = *q, key = *k;  // copies: emitting nodes grows g.values
    ArgValue bias = graph::NoneArg{};
    if (mask) {
      std::optional<ValueId> built = attention_bias(rewriter, oracle, std::get<TensorArg>(a[3]).id, query, key, cuda);
      if (!built) {
        rewriter.append(std::move(node));
        continue;
      }
      bias = TensorArg{*built};
    }
    graph::Node lowered;
    // CUDA: the memory-efficient kernel, whose backward takes every floating dtype and a bias (eager picks flash or
    // cuDNN attention for 16-bit inputs where they apply, whose results hold the lengths as Python ints).
    if (cuda) {
      // (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
      lowered.op = "aten::_scaled_dot_product_efficient_attention";
      lowered.args = {a[0], a[1], a[2], bias, true, dropout, a.at(5), a.at(6)};
    } else {
      // (query, key, value, dropout_p, is_causal, *, attn_mask, scale)
      lowered.op = "aten::_scaled_dot_product_flash_attention_for_cpu";
      lowered.args = {a[0], a[1], a[2], 0.0, a.at(5), bias, a.at(6)};
    }
    lowered.overload = "default";
    std::vector<graph::TensorMeta> metas = oracle.complete_node(g, lowered);
    KILN_ASSERT(!metas.empty()) << lowered.qualified_name() << " has no results";
    // Result 0 is the attention output, under its old id and meta; the rest are new values.
    lowered.outputs = {node.outputs.at(0)};
    for (size_t r = 1; r < metas.size(); ++r) {
      graph::Value value;
      value.id = static_cast<ValueId>(g.values.size());
      value.meta = metas[r];
      value.meta.requires_grad = false;
      lowered.outputs.push_back(value.id);
      g.values.push_back(std::move(value));
    }
    rewriter.append(std::move(lowered));
  }
}

namespace {

// (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa): a float32 CUDA attention with a boolean mask
// (no is_causal, which ATen refuses with a mask, and no grouped-query heads, whose scores' shape differs).
bool mask_to_convert(const graph::Graph& g, const graph::Node& node) {
  if (node.qualified_name() != "aten::scaled_dot_product_attention.default") return false;
  const std::vector<ArgValue>& a = node.args;
  const graph::TensorMeta* q = tensor_meta(g, a.at(0));
  const graph::TensorMeta* k = tensor_meta(g, a.at(1));
  const graph::TensorMeta* mask = tensor_meta(g, a.at(3));
  return q && k && mask && mask->dtype == ScalarType::Bool && q->dtype == ScalarType::Float &&
         q->device.type == graph::DeviceType::CUDA && q->sizes.size() == 4 && k->sizes.size() == 4 && !flag(a.at(5)) &&
         !flag(a.at(7)) && mask_accepted(*mask, *q, *k);
}

}  // namespace

bool has_attention_mask_to_convert(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes)
    if (mask_to_convert(g, node)) return true;
  return false;
}

bool attention_masks_as_biases(graph::Graph& g, graph::OpOracle& oracle) {
  auto wanted = [&](const graph::Node& node) { return mask_to_convert(g, node); };
  if (!has_attention_mask_to_convert(g)) return false;
  GraphRewriter rewriter(g);
  std::vector<graph::Node> nodes = rewriter.take_nodes();
  std::map<std::pair<ValueId, std::vector<int64_t>>, ValueId> built;  // (mask, scores' shape) -> its bias
  bool changed = false;
  for (graph::Node& node : nodes) {
    if (wanted(node)) {
      const graph::TensorMeta query = *tensor_meta(g, node.args[0]), key = *tensor_meta(g, node.args[1]);
      const ValueId mask = std::get<TensorArg>(node.args[3]).id;
      const auto shape = std::make_pair(mask, std::vector<int64_t>{query.sizes[0], query.sizes[1], query.sizes[2], key.sizes[2]});
      auto found = built.find(shape);
      if (found == built.end()) {
        if (std::optional<ValueId> bias = attention_bias(rewriter, oracle, mask, query, key, /*align=*/true))
          found = built.emplace(shape, *bias).first;
      }
      if (found != built.end()) {
        node.args[3] = TensorArg{found->second};
        changed = true;
      }
    }
    rewriter.append(std::move(node));
  }
  return changed;
}

}  // namespace kiln::passes
