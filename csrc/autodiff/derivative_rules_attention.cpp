// Derivative rules, sixth part: attention. scaled_dot_product_attention's fused kernels (passes/lower_attention.h
// makes them of it where they apply, masked or not) have ATen backward kernels; anything else (a mask the kernels
// refuse, grouped-query heads) is differentiated with the math eager's own math path uses, the probabilities
// recomputed in the backward from the saved query, key, value and mask.
#include <cmath>
#include <limits>

#include "autodiff/derivative_rule_helpers.h"
#include "common/error.h"

namespace kiln::autodiff::detail {

namespace {

// ---- attention (passes/lower_attention.h makes these of scaled_dot_product_attention) ----------------
// _scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
//   -> (output, log_sumexp, philox_seed, philox_offset): the backward replays dropout from the saved RNG state and
// reads the same bias (passes/lower_attention makes it of a mask; it never needs grad).
// The kernel reads the output it is given with the strides of its own (batch, length, heads, dim) storage, the
// layout the forward kernel writes; the graph holds the output in the layout it recorded. So the backward gets a
// copy laid out as the kernel's own.
void rule_efficient_attention(RuleCall& c) {
  const std::vector<bool> mask = {c.needs(0), c.needs(1), c.needs(2), false};
  const ValueId by_length = c.b.emit("aten::transpose", "int", {tensor(c.result(0)), int64_t{1}, int64_t{2}});
  const ValueId packed = c.b.emit("aten::clone", "default", {tensor(by_length), graph::MemoryFormatArg{0}});
  const ValueId out = c.b.emit("aten::transpose", "int", {tensor(packed), int64_t{1}, int64_t{2}});
  auto grads = c.b.emit_all("aten::_scaled_dot_product_efficient_attention_backward", "default",
                            {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), tensor(c.input(2)), optional_tensor(c, 3),
                             tensor(out), tensor(c.result(1)), tensor(c.result(2)),
                             tensor(c.result(3)), c.arg(5), mask, c.arg(6), c.arg(7)});
  set_masked(c, grads, {0, 1, 2}, mask);
}
// _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp)
void rule_flash_attention_cpu(RuleCall& c) {
  auto grads = c.b.emit_all("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "default",
                            {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), tensor(c.input(2)),
                             tensor(c.result(0)), tensor(c.result(1)), c.arg(3), c.arg(4), optional_tensor(c, 5), c.arg(6)});
  set_masked(c, grads, {0, 1, 2}, {c.needs(0), c.needs(1), c.needs(2)});
}

// scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, *, scale, enable_gqa) without dropout, causal
// masking or grouped heads. With s the scale, P = softmax(q k^T s + mask): dv = P^T g, dP = g v^T,
// dS = P (dP - rowsum(dP P)) (softmax's backward), dq = dS k s, dk = dS^T q s. A bool mask keeps where True.
void rule_attention_math(RuleCall& c) {
  const bool mask_grad = c.is_tensor(3) && c.needs(3);  // a learned additive bias (T5's relative positions)
  if (!c.needs(0) && !c.needs(1) && !c.needs(2) && !mask_grad) return;
  if (c.number_arg(4) != 0.0) KILN_UNSUPPORTED() << "scaled_dot_product_attention with dropout outside its fused kernels";
  if (c.bool_arg(5)) KILN_UNSUPPORTED() << "causal scaled_dot_product_attention outside its fused kernels";
  if (c.bool_arg(7)) KILN_UNSUPPORTED() << "scaled_dot_product_attention with enable_gqa";
  if (mask_grad && c.input_meta(3).dtype == graph::ScalarType::Bool)
    KILN_UNSUPPORTED() << "scaled_dot_product_attention with a boolean mask that requires grad";
  const graph::TensorMeta& q = c.input_meta(0);
  if (q.dtype != graph::ScalarType::Float && q.dtype != graph::ScalarType::Double)
    KILN_UNSUPPORTED() << "scaled_dot_product_attention's math backward in reduced precision";
  const double scale = c.is_none(6) ? 1.0 / std::sqrt(static_cast<double>(q.sizes.back())) : c.number_arg(6);
  auto matmul = [&](ValueId a, ValueId b) { return op(c, "aten::matmul", {tensor(a), tensor(b)}); };
  auto t = [&](ValueId a) { return c.b.transpose(a, -2, -1); };
  ValueId scores = c.b.mul(matmul(c.input(0), t(c.input(1))), scale);
  if (c.is_tensor(3)) {
    if (c.input_meta(3).dtype == graph::ScalarType::Bool) {
      ValueId dropped = op(c, "aten::logical_not", {tensor(c.input(3))});
      scores = op(c, "aten::masked_fill", {tensor(scores), tensor(dropped), -std::numeric_limits<double>::infinity()},
                  "Scalar");
    } else {
      scores = c.b.add(scores, c.input(3));
    }
  }
  ValueId probs = op(c, "aten::_softmax", {tensor(scores), int64_t{-1}, false});
  if (c.needs(2)) c.set(2, matmul(t(probs), c.grad()));
  if (!c.needs(0) && !c.needs(1) && !mask_grad) return;
  ValueId d_probs = matmul(c.grad(), t(c.input(2)));
  // The scores' gradient before the scale: the additive mask's (summed to its shape by the joint builder).
  ValueId d_biased = op(c, "aten::_softmax_backward_data", {tensor(d_probs), tensor(probs), int64_t{-1},
                                                            graph::ScalarTypeArg{q.dtype}});
  if (mask_grad) c.set(3, d_biased);
  if (!c.needs(0) && !c.needs(1)) return;
  ValueId d_scores = c.b.mul(d_biased, scale);
  if (c.needs(0)) c.set(0, matmul(d_scores, c.input(1)));
  if (c.needs(1)) c.set(1, matmul(t(d_scores), c.input(0)));
}

}  // namespace

void add_attention_rules(std::map<std::string, DerivativeRule>& t) {
  const std::map<std::string, DerivativeRule> attention = {
      {"aten::_scaled_dot_product_efficient_attention.default", {rule_efficient_attention}},
      {"aten::_scaled_dot_product_flash_attention_for_cpu.default", {rule_flash_attention_cpu}},
      {"aten::scaled_dot_product_attention.default", {rule_attention_math}},
  };
  t.insert(attention.begin(), attention.end());
}

}  // namespace kiln::autodiff::detail
