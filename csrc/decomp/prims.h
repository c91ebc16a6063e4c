#pragma once
// The closed set of prims that ATen ops decompose into (DESIGN.md "decomp/ lowers ATen to a small closed
// set of prims"), and the builder interface decompositions write them through.
//
// Decompositions never see loops or buffers: they receive their operands as scalar values already loaded
// and broadcast into the op's index space, and return scalar values. Whoever implements PrimBuilder decides
// what a value is: fusion/ turns it into loop-IR expressions; autodiff (issue 6) can implement it again to
// record a prim graph. Views, broadcasting and strides are therefore not prims: they are index expressions
// that the implementer applies when it loads an operand.
//
// Torch-free.
#include <cstdint>
#include <vector>

#include "graph/graph.h"

namespace kiln::decomp {

enum class PrimOp : int8_t {
  // unary
  Neg, Abs, Exp, Log, Sqrt, Rsqrt, Tanh, Sigmoid, Erf, LogicalNot,
  // binary
  Add, Sub, Mul, Div, Maximum, Minimum, Pow, Lt, Le, Gt, Ge, Eq, Ne, LogicalAnd, LogicalOr,
  // ternary
  Where,
  // unary math (float compute types; rounding ops keep the dtype)
  Sin, Cos, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh, Log1p, Expm1, Log2, Log10, Exp2, Erfc,
  Ceil, Floor, Round, Trunc,
  Signbit,     // bool result
  BitwiseNot,  // integers and bool
  // binary math
  Atan2, Fmod, Hypot, Copysign, Fmax, Fmin,
  BitwiseAnd, BitwiseOr, BitwiseXor,  // integers and bool
  // special functions (float compute types)
  Lgamma, Digamma, Erfinv, Nextafter,
  // index check: CheckedIndex(i, extent) is i where 0 <= i < extent; outside it raises the graph's index error (CPU:
  // the value is then 0; CUDA: the kernel traps), as the gathered loads' check does (fusion/loop_ir.h)
  CheckedIndex,
  // casts are PrimBuilder::cast; reductions are PrimBuilder::reduce
};

/// Number of PrimOp values (for tables indexed by op).
constexpr int kPrimOpCount = static_cast<int>(PrimOp::CheckedIndex) + 1;

enum class ReduceOp : int8_t { Sum, Max, Min };

/// Everything kiln knows about one prim: one row of the prim table (decomp/prims.cpp), which the scheduler
/// and both code generators read, so that a new prim is added in one place.
enum class PrimKind : int8_t {
  kValue,       // the result has the (compute) dtype of its operands
  kPredicate,   // a bool result whatever its operands: logical ops, signbit
  kComparison,  // a bool result comparing its operands: lt, le, gt, ge, eq, ne
};

struct PrimFacts {
  PrimOp op;
  const char* name;  // "add", "exp" ...: kernel names and verifier messages
  PrimKind kind;
  // How the code generators print it: $a $b $c are the operands' names, $T their compute type (the first
  // operand's; Where's second, since its first is the condition).
  const char* cpp;   // C++ (codegen/cpp), over device_lib/cpp_prelude.h's helpers
  const char* cuda;  // CUDA C (codegen/cuda), over device_lib/cuda/kiln_scalar.cuh's helpers
};

/// The prim table's row for `op`.
const PrimFacts& prim_facts(PrimOp op);
inline const char* prim_name(PrimOp op) { return prim_facts(op).name; }
inline bool is_comparison(PrimOp op) { return prim_facts(op).kind == PrimKind::kComparison; }
/// Prims whose result is bool whatever their operands (comparisons, logical ops, signbit).
inline bool has_bool_result(PrimOp op) { return prim_facts(op).kind != PrimKind::kValue; }
const char* reduce_name(ReduceOp op);

/// A scalar value inside a decomposition (an index into the implementer's value table).
using Prim = int32_t;

/// How a padded or windowed read (PrimBuilder::padded_arg) reaches one dim of its operand: the source index
/// is out_index * stride + window_index * dilation + offset, with out_index the node's output index in that
/// dim and window_index the index in window dim `window_dim` (-1: no window term). Padding is a negative
/// offset; a pooling window is (stride, dilation) over the window dim; a negative pad is a positive offset.
struct DimAccess {
  int64_t stride = 1;
  int64_t offset = 0;
  int window_dim = -1;
  int64_t dilation = 1;
};

class PrimBuilder {
 public:
  virtual ~PrimBuilder() = default;
  /// The node's argument `arg_index` as a scalar: a tensor operand loaded (in its own dtype) and broadcast
  /// to the op's index space, or a Python number (Tensor-position or Scalar argument) as a constant of
  /// its natural dtype (bool, int64, double).
  virtual Prim arg(int arg_index) = 0;
  /// The node's tensor argument `arg_index` (of the output's rank; Decomposition::padded_reads) read at the
  /// source index `dims` names per dim: its value where every source index lies inside the operand, else
  /// `fill` (converted to the operand's dtype). Nothing outside the operand is ever read.
  virtual Prim padded_arg(int arg_index, const std::vector<DimAccess>& dims, double fill) = 0;
  /// As padded_arg, for element `element` of the tensor-list argument `arg_index` (aten::cat's operands).
  virtual Prim padded_list_element(int arg_index, int element, const std::vector<DimAccess>& dims, double fill) = 0;
  /// Bool: true where every source index of `dims` lies in [0, extents[d]) (counting a window's elements).
  virtual Prim in_bounds(const std::vector<DimAccess>& dims, const std::vector<int64_t>& extents) = 0;
  /// A gathered read (Decomposition::gathered_reads): tensor argument `source_arg` read at the element whose index
  /// along its dim `source_dim` is the value of integer tensor argument `index_arg`. `source_dims[j]` is the node dim
  /// that source dim j runs along (ignored for source_dim); `index_dims[j]` the node dim that index dim j runs along.
  /// Index values outside the source dim are errors (they never read outside it).
  virtual Prim gather(int source_arg, int source_dim, const std::vector<int>& source_dims, int index_arg,
                      const std::vector<int>& index_dims) = 0;
  /// The node's index along its index-space dim `dim`, an int64 (an arange along that dim, broadcast over the others).
  virtual Prim iota(int dim) = 0;
  virtual Prim constant(double value, graph::ScalarType dtype) = 0;
  virtual Prim unary(PrimOp op, Prim a) = 0;
  virtual Prim binary(PrimOp op, Prim a, Prim b) = 0;
  virtual Prim where(Prim condition, Prim if_true, Prim if_false) = 0;
  /// Conversion with the rounding of the target dtype (a no-op when `a` already has it).
  virtual Prim cast(Prim a, graph::ScalarType dtype) = 0;
  /// Reduces `a` over the node's reduction dims (Decomposition::reduction_dims), or over its window dims
  /// (Decomposition::window_sizes).
  virtual Prim reduce(ReduceOp op, Prim a) = 0;
  virtual graph::ScalarType dtype(Prim a) const = 0;
  /// Number of elements one reduce() combines (the product of the reduced sizes).
  virtual int64_t reduction_size() const = 0;
  /// Declares the value of the node's output `index`.
  virtual void set_output(int index, Prim value) = 0;
};

}  // namespace kiln::decomp
