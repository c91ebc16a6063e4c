// Derivative rules, fifth part: matrix-vector products (vdot, addr, addmv, addbmm) and linear algebra on real
// tensors (inv, solve, solve_triangular, cholesky, cholesky_solve, lu_solve's right-hand side, slogdet). As in
// derivative_rules.cpp, each rule mirrors eager's formula (tools/autograd/derivatives.yaml and FunctionsManual.cpp in
// PyTorch); the OpInfo gradient sweep (tests/python/test_opinfo_grad_sweep.py) compares them with eager.
#include <algorithm>

#include "autodiff/derivative_rule_helpers.h"
#include "common/error.h"

namespace kiln::autodiff::detail {

namespace {

// ---- linear algebra (real tensors) ------------------------------------------------------------------------
ValueId matrix_t(RuleCall& c, ValueId v) { return c.b.transpose(v, -2, -1); }
ValueId matmul(RuleCall& c, ValueId a, ValueId b) { return op(c, "aten::matmul", {tensor(a), tensor(b)}); }
// Identity matrices shaped, typed and placed as the (batched, square) matrices `a`.
ValueId identity_like(RuleCall& c, ValueId a) {
  ValueId diagonal = op(c, "aten::diagonal", {tensor(a), int64_t{0}, int64_t{-2}, int64_t{-1}});
  ValueId ones = ones_like(c, diagonal);
  return op(c, "aten::diag_embed", {tensor(ones), int64_t{0}, int64_t{-2}, int64_t{-1}});
}
void real_only(RuleCall& c) {
  if (is_complex(c.input_meta(0).dtype)) KILN_UNSUPPORTED() << c.node().qualified_name() << " of complex tensors";
}
void rule_inv(RuleCall& c) {  // linalg_inv_ex(A) -> (inverse, info): -inverse^T grad inverse^T
  if (!c.needs(0)) return;
  real_only(c);
  ValueId inverse_t = matrix_t(c, c.result(0));
  c.set(0, c.b.neg(matmul(c, matmul(c, inverse_t, c.grad()), inverse_t)));
}
// _linalg_solve_ex(A, B, *, left, check_errors) -> (X, LU, pivots, info): B gets A^-T grad, A gets -gB X^T (X^T gB
// on the right). The returned LU is not reused: whether it factors A or A^T depends on A's layout (eager's
// backward asks A.is_contiguous()), which a graph built ahead of time does not pin.
void rule_solve(RuleCall& c) {
  if (!c.needs(0) && !c.needs(1)) return;
  real_only(c);
  const std::vector<int64_t>& a = c.input_meta(0).sizes;
  const std::vector<int64_t>& b = c.input_meta(1).sizes;
  const bool left = c.bool_arg(2);
  // torch.linalg.solve takes B as a (batch of) vector(s) when it is 1-D or shaped as A without its last dim.
  const bool vectors = b.size() == 1 || (b.size() + 1 == a.size() && std::equal(b.begin(), b.end(), a.begin()));
  if (vectors && !left) KILN_UNSUPPORTED() << "linalg.solve of vectors with left=False";
  ValueId grad_b = op(c, "aten::linalg_solve", {tensor(matrix_t(c, c.input(0))), tensor(c.grad()), left});
  if (c.needs(1)) c.set(1, grad_b);
  if (!c.needs(0)) return;
  if (vectors) {  // -outer(gB, X) over the last dim
    ValueId column = op(c, "aten::unsqueeze", {tensor(grad_b), int64_t{-1}});
    ValueId row = op(c, "aten::unsqueeze", {tensor(c.result(0)), int64_t{-2}});
    c.set(0, c.b.neg(c.b.mul(column, row)));
    return;
  }
  ValueId x_t = matrix_t(c, c.result(0));
  c.set(0, c.b.neg(left ? matmul(c, grad_b, x_t) : matmul(c, x_t, grad_b)));
}
// cholesky_solve(B, L, upper): X = (L L^T)^-1 B. B gets cholesky_solve(grad, L); L gets -(C + C^T) L (L (C + C^T)
// when upper), with C = gB X^T (eager's cholesky_solve_backward).
void rule_cholesky_solve(RuleCall& c) {
  if (!c.needs(0) && !c.needs(1)) return;
  real_only(c);
  const bool upper = c.bool_arg(2);
  ValueId grad_b = op(c, "aten::cholesky_solve", {tensor(c.grad()), tensor(c.input(1)), upper});
  if (c.needs(0)) c.set(0, grad_b);
  if (c.needs(1)) {
    ValueId common = matmul(c, grad_b, matrix_t(c, c.result(0)));
    common = c.b.add(common, matrix_t(c, common));
    c.set(1, c.b.neg(upper ? matmul(c, c.input(1), common) : matmul(c, common, c.input(1))));
  }
}
// linalg_lu_solve(LU, pivots, B, *, left, adjoint): B gets the solve with the adjoint flag flipped. The LU factors'
// own gradient keeps the eager interpreter.
void rule_lu_solve(RuleCall& c) {
  if (c.needs(0)) KILN_UNSUPPORTED() << "linalg_lu_solve with LU factors that require grad";
  if (!c.needs(2)) return;
  real_only(c);
  c.set(2, op(c, "aten::linalg_lu_solve", {tensor(c.input(0)), tensor(c.input(1)), tensor(c.grad()), c.arg(3), !c.bool_arg(4)}));
}
// linalg_solve_triangular(A, B, *, upper, left, unitriangular): gB solves with A^T; gA is -gB X^T (X^T gB on the
// right) cut to A's triangle (without the diagonal when it is taken as ones).
void rule_solve_triangular(RuleCall& c) {
  if (!c.needs(0) && !c.needs(1)) return;
  real_only(c);
  const bool upper = c.bool_arg(2), left = c.bool_arg(3), unit = c.bool_arg(4);
  ValueId grad_b = op(c, "aten::linalg_solve_triangular", {tensor(matrix_t(c, c.input(0))), tensor(c.grad()), !upper, left, unit});
  if (c.needs(1)) c.set(1, grad_b);
  if (c.needs(0)) {
    ValueId x_t = matrix_t(c, c.result(0));
    ValueId g = c.b.neg(left ? matmul(c, grad_b, x_t) : matmul(c, x_t, grad_b));
    c.set(0, upper ? op(c, "aten::triu", {tensor(g), int64_t{unit ? 1 : 0}}) : op(c, "aten::tril", {tensor(g), int64_t{unit ? -1 : 0}}));
  }
}
// cholesky (linalg_cholesky_ex(A, *, upper, check_errors) -> (L, info); cholesky(A, upper) -> L): Murray's formula
// as eager's cholesky_backward, symmetrised.
void cholesky_back(RuleCall& c, bool upper) {
  if (!c.needs(0)) return;
  real_only(c);
  ValueId factor = c.result(0), grad = c.grad();
  if (upper) {
    factor = matrix_t(c, factor);
    grad = matrix_t(c, grad);
  }
  ValueId eye = identity_like(c, c.input(0));
  ValueId inverse = op(c, "aten::linalg_solve_triangular", {tensor(factor), tensor(eye), false, true, false});
  ValueId phi = op(c, "aten::tril", {tensor(matmul(c, matrix_t(c, factor), grad)), int64_t{0}});
  ValueId half_diagonal = c.b.mul(op(c, "aten::diagonal", {tensor(phi), int64_t{0}, int64_t{-2}, int64_t{-1}}), 0.5);
  phi = op(c, "aten::diagonal_scatter", {tensor(phi), tensor(half_diagonal), int64_t{0}, int64_t{-2}, int64_t{-1}});
  ValueId g = matmul(c, matmul(c, matrix_t(c, inverse), phi), inverse);
  c.set(0, c.b.mul(c.b.add(g, matrix_t(c, g)), 0.5));
}
void rule_cholesky_ex(RuleCall& c) { cholesky_back(c, c.bool_arg(1)); }
void rule_cholesky(RuleCall& c) { cholesky_back(c, c.bool_arg(1)); }
// _linalg_slogdet(A) -> (sign, logabsdet, LU, pivots): logabsdet's gradient times A^-T; sign is piecewise constant.
// (The returned LU factors A^T for a contiguous A: the inverse is computed again rather than read from it.)
void rule_slogdet(RuleCall& c) {
  if (!c.needs(0)) return;
  real_only(c);
  auto g = c.grad_at(1);
  if (!g) {
    c.set(0, zeros_like(c, c.input(0)));
    return;
  }
  ValueId inverse_t = matrix_t(c, c.b.emit_all("aten::linalg_inv_ex", "default", {tensor(c.input(0)), false}).at(0));
  std::vector<int64_t> kept_sizes = c.b.meta(*g).sizes;
  kept_sizes.push_back(1);
  kept_sizes.push_back(1);
  c.set(0, c.b.mul(c.b.reshape(*g, kept_sizes), inverse_t));
}

// ---- products ------------------------------------------------------------------------------------------
void rule_vdot(RuleCall& c) {  // real tensors: as dot
  if (is_complex(c.input_meta(0).dtype)) KILN_UNSUPPORTED() << "vdot of complex tensors";
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.input(1)));
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.input(0)));
}
void rule_addr(RuleCall& c) {  // addr(self, vec1, vec2, beta, alpha) = beta self + alpha outer(vec1, vec2)
  const double beta = c.number_arg(3), alpha = c.number_arg(4);
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), beta));
  if (c.needs(1)) c.set(1, c.b.mul(op(c, "aten::mv", {tensor(c.grad()), tensor(c.input(2))}), alpha));
  if (c.needs(2)) c.set(2, c.b.mul(op(c, "aten::mv", {tensor(t(c, c.grad())), tensor(c.input(1))}), alpha));
}
void rule_addmv(RuleCall& c) {  // addmv(self, mat, vec, beta, alpha) = beta self + alpha mat @ vec
  const double beta = c.number_arg(3), alpha = c.number_arg(4);
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), beta));
  if (c.needs(1)) c.set(1, c.b.mul(op(c, "aten::outer", {tensor(c.grad()), tensor(c.input(2))}), alpha));
  if (c.needs(2)) c.set(2, c.b.mul(op(c, "aten::mv", {tensor(t(c, c.input(1))), tensor(c.grad())}), alpha));
}
void rule_addbmm(RuleCall& c) {  // addbmm(self, batch1 [b, n, m], batch2 [b, m, p], beta, alpha)
  const double beta = c.number_arg(3), alpha = c.number_arg(4);
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), beta));
  if (!c.needs(1) && !c.needs(2)) return;
  const std::vector<int64_t>& s1 = c.input_meta(1).sizes;
  const std::vector<int64_t>& s2 = c.input_meta(2).sizes;
  ValueId spread = c.b.expand(c.b.reshape(c.grad(), {1, s1.at(1), s2.at(2)}), {s1.at(0), s1.at(1), s2.at(2)});
  if (c.needs(1)) c.set(1, c.b.mul(op(c, "aten::bmm", {tensor(spread), tensor(c.b.transpose(c.input(2), 1, 2))}), alpha));
  if (c.needs(2)) c.set(2, c.b.mul(op(c, "aten::bmm", {tensor(c.b.transpose(c.input(1), 1, 2)), tensor(spread)}), alpha));
}

}  // namespace

void add_linalg_rules(std::map<std::string, DerivativeRule>& t) {
  const std::map<std::string, DerivativeRule> linalg = {
      {"aten::linalg_inv_ex.default", {rule_inv}},
      {"aten::_linalg_solve_ex.default", {rule_solve}},
      {"aten::linalg_solve_triangular.default", {rule_solve_triangular}},
      {"aten::cholesky_solve.default", {rule_cholesky_solve}},
      {"aten::linalg_lu_solve.default", {rule_lu_solve}},
      {"aten::linalg_cholesky_ex.default", {rule_cholesky_ex}},
      {"aten::cholesky.default", {rule_cholesky}},
      {"aten::_linalg_slogdet.default", {.emit = rule_slogdet, .differentiable_results = 2, .all_results = true}},
      {"aten::vdot.default", {rule_vdot}},
      {"aten::addr.default", {rule_addr}},
      {"aten::addmv.default", {rule_addmv}},
      {"aten::addbmm.default", {rule_addbmm}},
  };
  t.insert(linalg.begin(), linalg.end());
}

}  // namespace kiln::autodiff::detail
