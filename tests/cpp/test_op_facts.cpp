// decomp/prims (the prim table): what the scheduler and both code generators read.
#include <catch2/catch.hpp>

#include <string>

#include "decomp/prims.h"

using kiln::decomp::PrimOp;

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
