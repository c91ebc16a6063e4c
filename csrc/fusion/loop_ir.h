#pragma once
// The loop IR: what a fused kernel computes, independent of the device that will run it.
//
// A kernel iterates over a *domain* (a shape) whose dims are either outer (parallel) or reduced. Every
// buffer access is an affine index expression of the domain's loop variables (offset + sum of stride *
// index), which is how views, broadcasting (stride 0) and arbitrary strides are expressed without copies.
// The body is a list of scalar expressions in SSA order (loads, constants, prims, casts, reductions);
// stores write chosen expressions to output buffers. An expression that does not depend on a reduced
// loop variable is computed once per outer index; a Reduce expression accumulates its operand over the
// reduced dims. codegen/cpp and codegen/cuda lower the same Kernel.
//
// Padding and pooling windows add one thing: a *bounds predicate* (InBounds: 0 <= index < extent for a few
// affine indices) and loads guarded by it (`mask ? buf[index] : fill`), so a read at a shifted or windowed
// index never touches memory outside its buffer. A pooling window is a set of reduced dims of the domain.
//
// Embedding, gather and index_select add *gathered loads*: a load whose index has one more term, a run-time
// integer (another expression's value) times a stride, `buf[affine index + value * gather_stride]`. The value is
// checked against [0, gather_extent) before the read: CPU kernels then read element 0 and raise the graph's
// index error flag (the run plan turns it into an exception), CUDA kernels trap, as eager's device-side assert.
//
// Scatters with one index per slice (decomp/decompose_gather.cpp) add *iotas*: the integer value of an affine index
// of the loop variables (`i1`, an arange along a dim), compared with the run-time index in the same loop instead of
// writing through it; the index is checked the same way (decomp::PrimOp::CheckedIndex).
//
// Torch-free.
#include <cstdint>
#include <string>
#include <vector>

#include "decomp/prims.h"
#include "graph/graph.h"

namespace kiln::fusion {

/// offset + sum_d strides[d] * index[d], in elements of the buffer's dtype; strides has one entry per
/// domain dim (0 where the access does not depend on that dim).
struct IndexExpr {
  int64_t offset = 0;
  std::vector<int64_t> strides;
};

struct KernelBuffer {
  graph::ValueId value;  // the graph value whose storage this is (the root of a view chain for loads)
  graph::ScalarType dtype;
  bool is_output = false;
};

/// One condition of a bounds predicate: 0 <= index < extent.
struct Bound {
  IndexExpr index;
  int64_t extent = 0;
};

enum class ExprKind : int8_t { Load, Constant, Unary, Binary, Where, Cast, Reduce, InBounds, Iota };

struct Expr {
  ExprKind kind;
  graph::ScalarType dtype;  // the value's dtype (half/bfloat16 are computed in float by code generators)
  decomp::PrimOp op = decomp::PrimOp::Add;          // Unary, Binary
  decomp::ReduceOp reduce_op = decomp::ReduceOp::Sum;  // Reduce
  int32_t operands[3] = {-1, -1, -1};
  double constant = 0;  // Constant; a guarded Load's value where its guard is false
  int32_t buffer = -1;  // Load; operands[0] is its guard (a bool expression), -1 when unguarded
  IndexExpr index;      // Load; Iota (its value, an int64: offset + sum of stride * loop variable)
  // Gathered Load: operands[1] is the integer expression whose value selects the element along the gathered dim
  // (-1: an affine load); gather_stride is that dim's stride, gather_extent its size.
  int64_t gather_stride = 0;
  int64_t gather_extent = 0;
  std::vector<Bound> bounds;  // InBounds: true when every bound holds
};

struct Store {
  int32_t buffer;
  int32_t expr;
  IndexExpr index;
};

struct Kernel {
  std::string name;  // kernel_<n>_<ops>
  std::vector<graph::NodeIndex> nodes;  // graph nodes it covers, in order
  std::vector<int64_t> domain;
  std::vector<bool> reduced;  // per domain dim
  std::vector<KernelBuffer> buffers;
  std::vector<Expr> exprs;
  std::vector<Store> stores;
  /// The reduced dims are a pooling window: a few elements per output, read at neighbouring indices.
  bool window_reduction = false;

  bool has_reduction() const {
    for (bool r : reduced)
      if (r) return true;
    return false;
  }
  /// Bounds predicates or gathered loads: code generators emit such kernels with scalar loads only (a guarded or
  /// gathered load's address is known only once its guard or index value is computed, element by element).
  bool scalar_loads_only() const {
    for (const Expr& e : exprs)
      if (e.kind == ExprKind::InBounds || is_gathered(e)) return true;
    return false;
  }
  static bool is_gathered(const Expr& e) { return e.kind == ExprKind::Load && e.operands[1] >= 0; }
  /// Gathered loads or checked indices: on CPU the run plan reads the index error flag after the kernel.
  bool checks_indices() const {
    for (const Expr& e : exprs)
      if (is_gathered(e) || (e.kind == ExprKind::Binary && e.op == decomp::PrimOp::CheckedIndex)) return true;
    return false;
  }
  /// Expressions with an index over the domain: loads and iotas (their strides move with the loops).
  static bool has_index(const Expr& e) { return e.kind == ExprKind::Load || e.kind == ExprKind::Iota; }
};

/// One step of a compiled graph, in execution order.
struct Step {
  enum class Kind : int8_t { Kernel, Extern } kind;
  int32_t index;  // into Schedule::kernels, or the graph node index of an extern call
};

struct Schedule {
  std::vector<Kernel> kernels;
  std::vector<Step> steps;
  /// Per value: true when it exists as a real tensor at run time (inputs, constants, extern results,
  /// stored kernel outputs, views run as extern calls). Everything else lives only inside a kernel.
  std::vector<bool> materialised;

  /// "2 kernels (kernel_0_add_mul_relu, ...), 1 extern (aten::addmm.default)".
  std::string summary() const;
};

/// Checks the invariants code generators rely on (operand order, buffer and index ranks, dtypes);
/// throws an internal error naming the kernel and expression.
void verify_kernel(const Kernel& k);

}  // namespace kiln::fusion
