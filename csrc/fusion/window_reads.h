#pragma once
// Padded and windowed reads in the loop IR (decomp::PrimBuilder::padded_arg): how a source tensor's dims map
// onto a kernel's domain when it is read at out_index * stride + window_index * dilation + offset, which of
// those source indices can leave the tensor (the bounds predicate), and the copy of a pointwise producer's
// expressions re-indexed that way (a producer recomputed per window element instead of materialised).
//
// Torch-free.
#include <cstdint>
#include <functional>
#include <vector>

#include "decomp/prims.h"
#include "fusion/loop_ir.h"

namespace kiln::fusion {

struct WindowMap {
  std::vector<decomp::DimAccess> dims;  ///< per source dim
  std::vector<int> out_dims;            ///< per source dim: the domain dim its output index runs along (-1: none)
  std::vector<int> window_dims;         ///< per window dim: its domain dim
  std::vector<int64_t> domain;          ///< the kernel's domain sizes

  /// `source` (offset + strides over the source's dims) re-expressed over the domain.
  IndexExpr compose(const IndexExpr& source) const;
  /// Per source dim: true when its index can leave [0, extents[d]) for some index of the domain.
  std::vector<bool> bounded_dims(const std::vector<int64_t>& extents) const;
  /// The conditions under which every source index lies in [0, extents[d]), one per bounded dim (empty:
  /// always in range).
  std::vector<Bound> bounds(const std::vector<int64_t>& extents) const;
};

/// Appends an expression to the kernel being built (with its structural CSE) and returns its index.
using AddExpr = std::function<int32_t(Expr)>;
/// The kernel's input buffer for a graph value's storage.
using BufferFor = std::function<int32_t(graph::ValueId)>;

/// Number of distinct expressions `root` of `from` is computed from (itself included), or -1 when one of them
/// is a reduction (then it cannot be recomputed elsewhere).
int recompute_size(const Kernel& from, int32_t root);

/// Copies expression `root` of the pointwise kernel `from` (its domain = the source's shape) into the kernel
/// being built, each load re-indexed through `map` and, when it moves along a source dim that `bounded` marks,
/// guarded by `guard` (so it never reads outside its buffer). Returns the copy of `root`. `from` may be the
/// kernel being built: it is read by index, between appends.
int32_t recompute_through(const Kernel& from, int32_t root, const WindowMap& map, const std::vector<bool>& bounded,
                          int32_t guard, const AddExpr& add, const BufferFor& buffer);

}  // namespace kiln::fusion
