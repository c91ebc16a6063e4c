#pragma once
// The loop IR: what a fused kernel computes, independent of the device that will run it.
//
// A kernel iterates over a *domain* (a shape) whose dims are either outer (parallel) or reduced. Every
// buffer access is an affine index expression of the domain's loop variables (offset + sum of stride *
// index), which is how views, broadcasting (stride 0) and arbitrary strides are expressed without copies.
// The body is a list of scalar expressions in SSA order (loads, constants, prims, casts, reductions);
// stores write chosen expressions to output buffers. An expression that does not depend on a reduced
// loop variable is computed once per outer index; a Reduce expression accumulates its operand over the
// reduced dims. codegen/cpp (and later codegen/cuda) lower the same Kernel.
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

enum class ExprKind : int8_t { Load, Constant, Unary, Binary, Where, Cast, Reduce };

struct Expr {
  ExprKind kind;
  graph::ScalarType dtype;  // the value's dtype (half/bfloat16 are computed in float by code generators)
  decomp::PrimOp op = decomp::PrimOp::Add;          // Unary, Binary
  decomp::ReduceOp reduce_op = decomp::ReduceOp::Sum;  // Reduce
  int32_t operands[3] = {-1, -1, -1};
  double constant = 0;  // Constant
  int32_t buffer = -1;  // Load
  IndexExpr index;      // Load
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

  bool has_reduction() const {
    for (bool r : reduced)
      if (r) return true;
    return false;
  }
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
