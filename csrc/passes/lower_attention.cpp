// scaled_dot_product_attention as a differentiable kernel (passes/lower_attention.h).
#include "passes/lower_attention.h"

#include <variant>

#include "common/error.h"

namespace kiln::passes {

namespace {

using graph::ArgValue;
using graph::ScalarType;
using graph::tensor_meta;

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

}  // namespace

void lower_attention_for_autodiff(graph::Graph& g, graph::OpOracle& oracle) {
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    graph::Node& node = g.nodes[n];
    if (node.qualified_name() != "aten::scaled_dot_product_attention.default") continue;
    // (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    const std::vector<ArgValue>& a = node.args;
    const graph::TensorMeta* q = tensor_meta(g, a.at(0));
    const graph::TensorMeta* k = tensor_meta(g, a.at(1));
    const graph::TensorMeta* v = tensor_meta(g, a.at(2));
    if (!q || !k || !v || !std::holds_alternative<graph::NoneArg>(a.at(3)) || flag(a.at(7)) ||
        !kernel_accepts(*q, *k, *v))
      continue;
    const double dropout = number(a.at(4), 0.0);
    graph::Node lowered;
    // CUDA: the memory-efficient kernel, whose backward takes every floating dtype (eager picks flash or cuDNN
    // attention for 16-bit inputs where they apply, whose results hold the lengths as Python ints).
    if (q->device.type == graph::DeviceType::CUDA) {
      // (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
      lowered.op = "aten::_scaled_dot_product_efficient_attention";
      lowered.args = {a[0], a[1], a[2], graph::NoneArg{}, true, dropout, a.at(5), a.at(6)};
    } else if (q->device.type == graph::DeviceType::CPU && dropout == 0.0) {  // CPU flash attention has no dropout
      // (query, key, value, dropout_p, is_causal, *, attn_mask, scale)
      lowered.op = "aten::_scaled_dot_product_flash_attention_for_cpu";
      lowered.args = {a[0], a[1], a[2], 0.0, a.at(5), graph::NoneArg{}, a.at(6)};
    } else {
      continue;
    }
    lowered.overload = "default";
    std::vector<graph::TensorMeta> metas = oracle.complete_node(g, lowered);
    KILN_ASSERT(!metas.empty()) << lowered.qualified_name() << " has no results";
    // Result 0 is the attention output, under its old id and meta; the rest are new values.
    const graph::ValueId output = node.outputs.at(0);
    lowered.outputs = {output};
    for (size_t r = 1; r < metas.size(); ++r) {
      graph::Value value;
      value.id = static_cast<graph::ValueId>(g.values.size());
      value.meta = metas[r];
      value.meta.requires_grad = false;
      value.producer = static_cast<graph::NodeIndex>(n);
      lowered.outputs.push_back(value.id);
      g.values.push_back(std::move(value));
    }
    g.nodes[n] = std::move(lowered);
  }
}

}  // namespace kiln::passes
