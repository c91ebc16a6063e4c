// fusion/in_place_outputs on hand-built kernels (torch-free): which outputs may take an input's storage.
#include <catch2/catch.hpp>

#include "fusion/in_place_outputs.h"

using kiln::fusion::Expr;
using kiln::fusion::ExprKind;
using kiln::fusion::IndexExpr;
using kiln::fusion::Kernel;
using kiln::graph::ScalarType;

namespace {

// A [4, 8] kernel: buffer 0 and 1 are inputs, buffer 2 the output; out = in0[load0] + in1[load1].
Kernel add_kernel(IndexExpr load0, IndexExpr load1, ScalarType in0_dtype = ScalarType::Float) {
  Kernel k;
  k.name = "kernel_0_add";
  k.domain = {4, 8};
  k.reduced = {false, false};
  k.buffers = {{0, in0_dtype, false}, {1, ScalarType::Float, false}, {2, ScalarType::Float, true}};
  Expr a{ExprKind::Load, in0_dtype};
  a.buffer = 0;
  a.index = std::move(load0);
  Expr b{ExprKind::Load, ScalarType::Float};
  b.buffer = 1;
  b.index = std::move(load1);
  Expr sum{ExprKind::Binary, ScalarType::Float};
  sum.operands[0] = 0;
  sum.operands[1] = 1;
  k.exprs = {a, b, sum};
  k.stores = {{2, 2, IndexExpr{0, {8, 1}}}};
  return k;
}

}  // namespace

TEST_CASE("an output may overwrite an input read at its own index", "[in_place]") {
  const auto source = kiln::fusion::in_place_sources(add_kernel(IndexExpr{0, {8, 1}}, IndexExpr{0, {0, 1}}));
  REQUIRE(source == std::vector<int32_t>{-1, -1, 0});
}

TEST_CASE("inputs read elsewhere, broadcast or of another dtype are not offered", "[in_place]") {
  // transposed read of buffer 0, broadcast read of buffer 1
  REQUIRE(kiln::fusion::in_place_sources(add_kernel(IndexExpr{0, {1, 4}}, IndexExpr{0, {0, 1}}))[2] == -1);
  // a shifted read
  REQUIRE(kiln::fusion::in_place_sources(add_kernel(IndexExpr{1, {8, 1}}, IndexExpr{0, {0, 1}}))[2] == -1);
  // the second input qualifies when the first does not
  REQUIRE(kiln::fusion::in_place_sources(add_kernel(IndexExpr{0, {1, 4}}, IndexExpr{0, {8, 1}}))[2] == 1);
  // another dtype
  REQUIRE(kiln::fusion::in_place_sources(add_kernel(IndexExpr{0, {8, 1}}, IndexExpr{0, {0, 1}}, ScalarType::Half))[2] ==
          -1);
}

TEST_CASE("an input also read at another index, or a reduction, is never overwritten", "[in_place]") {
  Kernel k = add_kernel(IndexExpr{0, {8, 1}}, IndexExpr{0, {0, 1}});
  Expr again{ExprKind::Load, ScalarType::Float};
  again.buffer = 0;
  again.index = IndexExpr{1, {8, 1}};
  k.exprs.push_back(again);
  REQUIRE(kiln::fusion::in_place_sources(k)[2] == -1);

  Kernel r = add_kernel(IndexExpr{0, {8, 1}}, IndexExpr{0, {0, 1}});
  r.reduced = {false, true};
  REQUIRE(kiln::fusion::in_place_sources(r)[2] == -1);
}

TEST_CASE("an input only a later store reads is not overwritten by an earlier one", "[in_place]") {
  // A = in1[i]; B = in0[i] + in1[i]. The generators load in0 only when they reach B's store, after A's: A may
  // take in1 (loaded before A's store), B may take in0, but A must not take in0.
  Kernel k = add_kernel(IndexExpr{0, {8, 1}}, IndexExpr{0, {8, 1}});
  k.buffers.push_back({3, ScalarType::Float, true});
  k.stores = {{2, 1, IndexExpr{0, {8, 1}}}, {3, 2, IndexExpr{0, {8, 1}}}};
  REQUIRE(kiln::fusion::in_place_sources(k) == std::vector<int32_t>{-1, -1, 1, 0});
}
