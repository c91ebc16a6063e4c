#include "codegen/cuda/cuda_text.h"

#include <cmath>
#include <iomanip>
#include <sstream>

#include "common/error.h"

namespace kiln::codegen::cuda {

using decomp::PrimOp;
using decomp::ReduceOp;
using graph::ScalarType;

namespace {

constexpr TypeInfo kTypes[] = {
    {ScalarType::Bool, "bool", "bool", 1, "false", "true"},
    {ScalarType::Byte, "unsigned char", "unsigned char", 1, "0", "255"},
    {ScalarType::Char, "signed char", "signed char", 1, "(-128)", "127"},
    {ScalarType::Short, "short", "short", 2, "(-32768)", "32767"},
    {ScalarType::Int, "int", "int", 4, "(-2147483647 - 1)", "2147483647"},
    {ScalarType::Long, "long long", "long long", 8, "(-9223372036854775807LL - 1)", "9223372036854775807LL"},
    {ScalarType::Half, "kiln::half_t", "float", 2, nullptr, nullptr},
    {ScalarType::BFloat16, "kiln::bf16_t", "float", 2, nullptr, nullptr},
    {ScalarType::Float, "float", "float", 4, nullptr, nullptr},
    {ScalarType::Double, "double", "double", 8, nullptr, nullptr},
};

}  // namespace

const TypeInfo& type_info(ScalarType t) {
  for (const TypeInfo& info : kTypes)
    if (info.dtype == t) return info;
  KILN_CHECK(false) << "the CUDA code generator has no type for dtype " << graph::scalar_type_name(t);
  return kTypes[0];
}

std::string literal(double v, ScalarType t) {
  const std::string ct = compute_type(t);
  if (t == ScalarType::Bool) return v != 0 ? "true" : "false";
  std::ostringstream out;
  if (!graph::is_floating_or_complex(t)) {
    // -2^63 has no literal (9223372036854775808 overflows before the minus applies)
    if (v <= -9223372036854775808.0) return "static_cast<" + ct + ">(" + type_info(ScalarType::Long).lowest + ")";
    out << "static_cast<" << ct << ">(" << static_cast<long long>(v) << "LL)";
    return out.str();
  }
  if (std::isnan(v)) return "kiln::quiet_nan<" + ct + ">()";
  if (std::isinf(v)) return std::string(v < 0 ? "-" : "") + "kiln::infinity<" + ct + ">()";
  out << "static_cast<" << ct << ">(" << std::setprecision(17) << v << ")";
  return out.str();
}

const char* prim_format(PrimOp op) { return decomp::prim_facts(op).cuda; }

const char* combiner(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "kiln::SumCombine";
    case ReduceOp::Max: return "kiln::MaxCombine";
    case ReduceOp::Min: return "kiln::MinCombine";
  }
  return "";
}

std::string identity(ReduceOp op, ScalarType t) {
  if (op == ReduceOp::Sum) return literal(0, t);
  const bool max = op == ReduceOp::Max;
  if (graph::is_floating_or_complex(t)) return std::string(max ? "-" : "") + "kiln::infinity<" + compute_type(t) + ">()";
  const TypeInfo& info = type_info(t);
  return std::string("static_cast<") + info.compute + ">(" + (max ? info.lowest : info.highest) + ")";
}


std::string index_text(const std::vector<int64_t>& strides, int64_t offset, SizeArguments& sizes) {
  std::ostringstream out;
  out << sizes.stride(offset, std::to_string(offset));
  for (size_t l = 0; l < strides.size(); ++l)
    if (strides[l] != 0) out << " + " << sizes.stride(strides[l], std::to_string(strides[l])) << " * i" << l;
  return out.str();
}

std::string in_bounds_text(const fusion::Expr& x, const std::vector<std::vector<int64_t>>& strides,
                           SizeArguments& sizes) {
  std::string test;
  for (size_t b = 0; b < x.bounds.size(); ++b) {
    const std::string i = "(" + index_text(strides[b], x.bounds[b].index.offset, sizes) + ")";
    test += (b ? " && " : "") + i + " >= 0 && " + i + " < " + sizes(x.bounds[b].extent);
  }
  return "(" + test + ")";
}

std::string guarded_load_text(const std::string& guard, const std::string& load, double fill, ScalarType t) {
  return "(" + guard + " ? " + load + " : " + literal(fill, t) + ")";
}

}  // namespace kiln::codegen::cuda
