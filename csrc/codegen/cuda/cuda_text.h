#pragma once
// The CUDA C spelling of loop-IR pieces, shared by the kernel emitter (emit_cuda.cpp): dtypes, literals, prims,
// reduction combiners and identities, affine indices, bounds predicates and guarded loads.
// Torch-free.
#include <string>
#include <vector>

#include "codegen/size_arguments.h"
#include "decomp/prims.h"
#include "fusion/loop_ir.h"

namespace kiln::codegen::cuda {

struct TypeInfo {
  graph::ScalarType dtype;
  const char* storage;
  const char* compute;
  int bytes;
  const char* lowest;   // identity of max for integer types
  const char* highest;  // identity of min for integer types
};

/// Throws kiln::Error for a dtype the CUDA generator has no type for.
const TypeInfo& type_info(graph::ScalarType t);
inline const char* storage_type(graph::ScalarType t) { return type_info(t).storage; }
inline const char* compute_type(graph::ScalarType t) { return type_info(t).compute; }

/// `v` as a constant of `t`'s compute type.
std::string literal(double v, graph::ScalarType t);
/// The prim's CUDA format string (the prim table's, decomp/prims.h): $a $b $c are operand names, $T the operands'
/// compute type.
const char* prim_format(decomp::PrimOp op);
/// kiln_reduce.cuh's combiner struct for `op`, and the identity it starts from.
const char* combiner(decomp::ReduceOp op);
std::string identity(decomp::ReduceOp op, graph::ScalarType t);

/// `offset + s0 * i0 + ...` over the loop variables i<l> (zero strides left out); the offset and strides through
/// `sizes` (literals, or size slots).
std::string index_text(const std::vector<int64_t>& strides, int64_t offset, SizeArguments& sizes);
/// An InBounds expression: `(j >= 0 && j < extent && ...)`, with `strides` its bounds' merged strides.
std::string in_bounds_text(const fusion::Expr& x, const std::vector<std::vector<int64_t>>& strides,
                           SizeArguments& sizes);
/// A load guarded by `guard`: `(guard ? load : fill)`, reading nothing when the guard is false.
std::string guarded_load_text(const std::string& guard, const std::string& load, double fill, graph::ScalarType t);

}  // namespace kiln::codegen::cuda
