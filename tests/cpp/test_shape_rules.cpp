// graph/shape_rules: the expression logic of the symbolic shape rules without torch (broadcasting under facts,
// view's -1 inference, convolution and pooling sizes, slice clamping, refusals). tests/python/test_shape_rules.py
// checks every rule against PyTorch.
#include <catch2/catch.hpp>

#include "graph/shape_rules.h"

using namespace kiln::graph;
using namespace kiln::graph::shape;
using sym::SizeFacts;

namespace {

SymTensorMeta contiguous(std::vector<Expr> sizes) {
  SymTensorMeta t;
  t.strides = contiguous_strides(sizes);
  t.sizes = std::move(sizes);
  return t;
}

std::vector<std::string> texts(const std::vector<Expr>& exprs) {
  std::vector<std::string> out;
  for (const Expr& e : exprs) out.push_back(e.to_string());
  return out;
}

std::vector<std::string> assumption_texts(const RuleResult& r) {
  std::vector<std::string> out;
  for (const Assumption& a : r.assumptions) out.push_back(a.to_string());
  return out;
}

}  // namespace

TEST_CASE("broadcasting decides size 1 and assumes equal symbols", "[shape_rules]") {
  SizeFacts facts;
  Expr s0 = facts.new_symbol(), s1 = facts.new_symbol(), s2 = facts.new_symbol();
  RuleResult r = infer_shapes("aten::add.Tensor", {contiguous({s0, 1}), contiguous({s1}), Expr(1)}, facts);
  REQUIRE(r.has_rule);
  CHECK(texts(r.outputs[0]->sizes) == std::vector<std::string>{"s0", "s1"});
  CHECK(texts(r.outputs[0]->strides) == std::vector<std::string>{"s1", "1"});
  CHECK(r.assumptions.empty());

  r = infer_shapes("aten::mul.Tensor", {contiguous({s0, s1}), contiguous({s2}), Expr(1)}, facts);
  REQUIRE(r.has_rule);
  CHECK(assumption_texts(r) == std::vector<std::string>{"s1 == s2"});
  CHECK(r.assumptions[0].holds({{0, 3}, {1, 5}, {2, 5}}));
  CHECK(!r.assumptions[0].holds({{0, 3}, {1, 5}, {2, 6}}));

  // A symbol (>= 2) against a constant other than 1: equal or eager raises.
  r = infer_shapes("aten::mul.Tensor", {contiguous({s0}), contiguous({Expr(4)}), Expr(1)}, facts);
  CHECK(assumption_texts(r) == std::vector<std::string>{"s0 == 4"});
  // Two different constants: eager raises, kiln has no rule.
  r = infer_shapes("aten::mul.Tensor", {contiguous({Expr(3)}), contiguous({Expr(4)}), Expr(1)}, facts);
  CHECK(!r.has_rule);
}

TEST_CASE("pointwise layouts follow the operands' stride order where it is proven", "[shape_rules]") {
  SizeFacts facts;
  Expr s0 = facts.new_symbol(), s1 = facts.new_symbol();
  SymTensorMeta transposed = contiguous({s1, s0});
  std::swap(transposed.sizes[0], transposed.sizes[1]);
  std::swap(transposed.strides[0], transposed.strides[1]);  // [s0, s1] with strides (1, s0)
  RuleResult r = infer_shapes("aten::exp.default", {transposed}, facts);
  REQUIRE(r.has_rule);
  CHECK(texts(r.outputs[0]->strides) == std::vector<std::string>{"1", "s0"});
  // Strides that are independent symbols cannot be ordered: no rule.
  SymTensorMeta odd = contiguous({s0, s1});
  odd.strides = {facts.new_symbol(), facts.new_symbol()};
  r = infer_shapes("aten::add.Tensor", {odd, contiguous({s0, s1}), Expr(1)}, facts);
  CHECK(!r.has_rule);
  CHECK(r.reason.find("cannot decide") != std::string::npos);
}

TEST_CASE("view infers -1 as an exact quotient or with a divisibility assumption", "[shape_rules]") {
  SizeFacts facts;
  Expr s0 = facts.new_symbol(), s1 = facts.new_symbol(), s2 = facts.new_symbol();
  RuleResult r = infer_shapes("aten::view.default", {contiguous({s0, s1, s2}), std::vector<Expr>{s0 * s1, -1}}, facts);
  REQUIRE(r.has_rule);
  CHECK(texts(r.outputs[0]->sizes) == std::vector<std::string>{"s0*s1", "s2"});
  CHECK(r.assumptions.empty());

  r = infer_shapes("aten::view.default", {contiguous({s0, s1}), std::vector<Expr>{Expr(-1), Expr(4)}}, facts);
  REQUIRE(r.has_rule);
  CHECK(texts(r.outputs[0]->sizes) == std::vector<std::string>{"floordiv(s0*s1, 4)", "4"});
  CHECK(assumption_texts(r) == std::vector<std::string>{"s0*s1 % 4 == 0"});

  // Known divisibility proves it; a divisibility assumption on a symbol is recorded into the facts.
  SizeFacts facts8;
  Expr t0 = facts8.new_symbol();
  facts8.add_divisor(t0, 8);
  r = infer_shapes("aten::view.default", {contiguous({t0}), std::vector<Expr>{Expr(-1), Expr(4)}}, facts8);
  CHECK(r.assumptions.empty());
  r = infer_shapes("aten::view.default", {contiguous({s0}), std::vector<Expr>{Expr(-1), Expr(3)}}, facts);
  CHECK(assumption_texts(r) == std::vector<std::string>{"s0 % 3 == 0"});
  CHECK(facts.divisor(s0.symbol_id()) == 3);

  CHECK(exact_quotient(s0 * s1 * 4, s1 * 2).value() == s0 * 2);
  CHECK(!exact_quotient(s0 * 4, s1));
  CHECK(!exact_quotient(s0 + 1, s0));
}

TEST_CASE("convolution and pooling sizes are floordiv expressions", "[shape_rules]") {
  SizeFacts facts;
  Expr h = facts.new_symbol();
  Expr out = conv_output_size(h, 3, 2, 1, 1);
  CHECK(out.to_string() == "floordiv(s0 + 1, 2)");
  for (int64_t v : {2, 3, 7, 8, 13})
    CHECK(out.evaluate({{0, v}}) == (v + 2 - 2 - 1) / 2 + 1);
  // ceil_mode's correction: ATen's loop and the min agree.
  for (int64_t k : {2, 3, 5})
    for (int64_t s : {1, 2, 3})
      for (int64_t p = 0; p <= k / 2; ++p)
        for (int64_t v = k; v < 30; ++v) {
          int64_t expected = (v + 2 * p - (k - 1) - 1 + (s - 1)) / s + 1;
          if ((expected - 1) * s >= v + p) --expected;
          CHECK(pool_output_size(h, k, s, p, 1, true).evaluate({{0, v}}) == expected);
        }
}

TEST_CASE("slice clamps symbolic bounds and select assumes its index in range", "[shape_rules]") {
  SizeFacts facts;
  Expr s0 = facts.new_symbol(), s1 = facts.new_symbol();
  SymTensorMeta x = contiguous({s0, s1});
  RuleResult r = infer_shapes("aten::slice.Tensor", {x, Expr(1), Expr(-2), NoneArg{}, Expr(1)}, facts);
  REQUIRE(r.has_rule);
  CHECK(r.outputs[0]->sizes[1].to_string() == "2");
  CHECK(r.outputs[0]->storage_offset.to_string() == "s1 - 2");
  r = infer_shapes("aten::slice.Tensor", {x, Expr(0), Expr(1), Expr(5), Expr(2)}, facts);
  REQUIRE(r.has_rule);
  for (int64_t v : {2, 3, 4, 5, 6, 9}) {
    int64_t end = std::min<int64_t>(5, v), start = 1;
    CHECK(r.outputs[0]->sizes[0].evaluate({{0, v}, {1, 3}}) == std::max<int64_t>(end - start + 1, 0) / 2);
  }
  r = infer_shapes("aten::select.int", {x, Expr(0), Expr(4)}, facts);
  REQUIRE(r.has_rule);
  CHECK(assumption_texts(r) == std::vector<std::string>{"4 < s0"});
  CHECK(facts.range(s0.symbol_id()).lo == 5);
  r = infer_shapes("aten::unbind.int", {x, Expr(0)}, facts);
  CHECK(!r.has_rule);  // a symbolic number of outputs
}

TEST_CASE("matmul-shaped ops assume equal inner dims; unknown ops have no rule", "[shape_rules]") {
  SizeFacts facts;
  Expr n = facts.new_symbol(), k = facts.new_symbol(), k2 = facts.new_symbol(), m = facts.new_symbol();
  RuleResult r = infer_shapes("aten::mm.default", {contiguous({n, k}), contiguous({k2, m})}, facts);
  REQUIRE(r.has_rule);
  CHECK(assumption_texts(r) == std::vector<std::string>{"s1 == s2"});
  CHECK(texts(r.outputs[0]->sizes) == std::vector<std::string>{"s0", "s3"});
  CHECK(!infer_shapes("aten::no_such_op.default", {}, facts).has_rule);
  CHECK(!infer_shapes("aten::mm.default", {contiguous({n, k})}, facts).has_rule);  // a missing argument
  CHECK(has_shape_rule("aten::convolution.default"));
  CHECK(shape_rule_ops().size() > 100);
}
