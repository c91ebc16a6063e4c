// graph/op_facts (the ATen op table) and decomp/prims (the prim table): what passes and code generators read.
#include <catch2/catch.hpp>

#include <set>
#include <string>

#include "decomp/prims.h"
#include "graph/op_facts.h"

using namespace kiln::graph;
using kiln::decomp::PrimOp;

TEST_CASE("op table: facts of elementwise ops", "[op_facts]") {
  const OpFacts& sigmoid = op_facts("aten::sigmoid.default");
  CHECK(sigmoid.name == "aten::sigmoid.default");
  CHECK(sigmoid.cost == OpCost::kPointwise);
  CHECK(sigmoid.layout == OpLayout::kFollowsOperands);
  CHECK_FALSE(sigmoid.random);
  CHECK(sigmoid.functional.empty());

  const OpFacts& mul = op_facts("aten::mul.Tensor");
  CHECK(mul.elementwise_binary);
  REQUIRE(mul.right_identity.has_value());
  CHECK(*mul.right_identity == 1.0);
  CHECK(*op_facts("aten::sub.Scalar").right_identity == 0.0);
  CHECK_FALSE(op_facts("aten::add.Tensor").right_identity.has_value());  // add's alpha scales the operand

  // Facts are kept per overload: div.Scalar is cheap to recompute but not known to keep channels-last.
  CHECK(op_facts("aten::div.Scalar").cost == OpCost::kPointwise);
  CHECK(op_facts("aten::div.Scalar").layout == OpLayout::kUnknown);
}

TEST_CASE("op table: an op without a row has every fact at its default", "[op_facts]") {
  const OpFacts& unknown = op_facts("aten::not_an_op.default");
  CHECK(unknown.name.empty());
  CHECK(unknown.cost == OpCost::kUnknown);
  CHECK(unknown.layout == OpLayout::kUnknown);
  CHECK(unknown.view == OpView::kNone);
  CHECK(unknown.reshape == OpReshape::kNone);
  CHECK(unknown.creates == OpCreates::kNothing);
  CHECK_FALSE(unknown.random);
  CHECK_FALSE(unknown.deterministic);
  CHECK_FALSE(unknown.side_effect_free);
  CHECK_FALSE(unknown.elementwise_binary);
  CHECK_FALSE(unknown.right_identity.has_value());
  CHECK(unknown.functional.empty());
  CHECK(unknown.buffer_update == OpBufferUpdate::kNo);
}

TEST_CASE("op table: views, factories, random and extern ops", "[op_facts]") {
  CHECK(op_facts("aten::view.default").view == OpView::kAffine);
  CHECK(op_facts("aten::view.default").reshape == OpReshape::kView);
  CHECK(op_facts("aten::reshape.default").view == OpView::kAffineWhenContiguous);
  CHECK(op_facts("aten::reshape.default").reshape == OpReshape::kMayCopy);
  CHECK(op_facts("aten::transpose.int").cost == OpCost::kView);
  CHECK(op_facts("aten::as_strided.default").cost == OpCost::kUnknown);  // not redone on a base by the backward

  CHECK(op_facts("aten::zeros_like.default").creates == OpCreates::kFill);
  CHECK(op_facts("aten::empty_strided.default").creates == OpCreates::kAllocation);
  CHECK(op_facts("aten::native_dropout.default").random);
  CHECK(op_facts("aten::mm.default").cost == OpCost::kMatmul);
  CHECK(op_facts("aten::mm.default").deterministic);
  CHECK(op_facts("aten::arange.start").deterministic);
  CHECK(op_facts("aten::slice_backward.default").side_effect_free);
  CHECK(op_facts("aten::max_pool2d_with_indices.default").layout == OpLayout::kFollowsFirstOperand);
  CHECK(op_facts("aten::cudnn_batch_norm.default").layout == OpLayout::kBatchNorm);
  CHECK(op_facts("aten::scaled_dot_product_attention.default").layout == OpLayout::kChosenByKernel);
}

TEST_CASE("op table: in-place ops and their functional twins", "[op_facts]") {
  CHECK(op_facts("aten::relu_.default").functional == "aten::relu.default");
  CHECK(op_facts("aten::transpose_.default").functional == "aten::transpose.int");
  CHECK(op_facts("aten::normal_.default").functional == "aten::normal_functional.default");
  CHECK(op_facts("aten::scatter_add_.default").any_operand_dtype);
  CHECK_FALSE(op_facts("aten::add_.Tensor").any_operand_dtype);
  CHECK(op_facts("aten::add_.Tensor").buffer_update == OpBufferUpdate::kYes);
  CHECK(op_facts("aten::div_.Tensor").buffer_update == OpBufferUpdate::kFloatingOnly);
  CHECK(op_facts("aten::div_.Tensor_mode").buffer_update == OpBufferUpdate::kNo);
  CHECK(op_facts("aten::native_batch_norm.default").mutates_only_buffers);
  CHECK(op_facts("aten::_native_batch_norm_legit.default").mutates_only_buffers);
  CHECK(op_facts("aten::cudnn_batch_norm.default").mutates_only_buffers);
  CHECK_FALSE(op_facts("aten::_native_batch_norm_legit_no_training.default").mutates_only_buffers);
  CHECK_FALSE(op_facts("aten::add_.Tensor").mutates_only_buffers);

  // Every twin names an overload; the in-place rows are the ops named op_.
  std::set<std::string_view> names;
  for (const OpFacts& row : all_op_facts()) {
    INFO(std::string(row.name));
    CHECK(names.insert(row.name).second);
    if (row.functional.empty()) {
      CHECK(row.buffer_update == OpBufferUpdate::kNo);
      CHECK_FALSE(row.any_operand_dtype);
      continue;
    }
    CHECK(split_qualified_name(row.name).first.back() == '_');
    CHECK_FALSE(split_qualified_name(row.functional).second.empty());
  }
  CHECK(split_qualified_name("aten::add.Tensor") == std::pair<std::string, std::string>{"aten::add", "Tensor"});
}

TEST_CASE("prim table: one row per prim, in PrimOp's order", "[op_facts]") {
  for (int i = 0; i < kiln::decomp::kPrimOpCount; ++i) {
    const auto& row = kiln::decomp::prim_facts(static_cast<PrimOp>(i));
    CHECK(static_cast<int>(row.op) == i);
    CHECK(row.name[0] != '\0');
    CHECK(std::string(row.cpp).find("$a") != std::string::npos);
    CHECK(std::string(row.cuda).find("$a") != std::string::npos);
  }
  CHECK(std::string(kiln::decomp::prim_name(PrimOp::Sigmoid)) == "sigmoid");
  CHECK(std::string(kiln::decomp::prim_facts(PrimOp::Sigmoid).cpp) == "kiln_sigmoid($a)");
  CHECK(std::string(kiln::decomp::prim_facts(PrimOp::Sigmoid).cuda) == "kiln::sigmoid_($a)");
  CHECK(kiln::decomp::is_comparison(PrimOp::Le));
  CHECK(kiln::decomp::has_bool_result(PrimOp::Le));
  CHECK_FALSE(kiln::decomp::is_comparison(PrimOp::LogicalAnd));
  CHECK(kiln::decomp::has_bool_result(PrimOp::LogicalAnd));
  CHECK(kiln::decomp::has_bool_result(PrimOp::Signbit));
  CHECK_FALSE(kiln::decomp::has_bool_result(PrimOp::Add));
  CHECK(std::string(kiln::decomp::reduce_name(kiln::decomp::ReduceOp::Max)) == "max");
}
