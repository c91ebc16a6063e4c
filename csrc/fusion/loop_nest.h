#pragma once
// A kernel's domain turned into loops, shared by the code generators: outer dims first (in the memory order
// of the first output), then reduced dims, size-1 dims dropped, and neighbours that every access walks
// contiguously merged into one loop (so a contiguous pointwise kernel is one flat loop whatever its rank).
// Each access's strides are re-expressed over the merged loops.
//
// Torch-free.
#include <cstdint>
#include <vector>

#include "fusion/loop_ir.h"

namespace kiln::fusion {

struct Loop {
  int64_t size;
  bool reduced;
};

struct LoopNest {
  std::vector<Loop> loops;                           // outer loops first, then reduced ones
  std::vector<std::vector<int64_t>> load_strides;   // per expr (loads and iotas; empty for the others)
  std::vector<std::vector<int64_t>> store_strides;  // per store
  std::vector<std::vector<std::vector<int64_t>>> bound_strides;  // per expr (InBounds only): per bound
  int outer_count = 0;

  /// True when an access with these (merged) strides moves along a reduced loop.
  bool runs_reduced(const std::vector<int64_t>& strides) const;
  /// Product of the outer loops' sizes, and of the reduced loops' sizes.
  int64_t outer_numel() const;
  int64_t reduced_numel() const;
};

LoopNest build_loop_nest(const Kernel& k);

/// Per expression: true when its value changes along the reduced loops (a load or bounds predicate that moves
/// along them, or anything computed from one), so code generators compute it inside the reduced loops.
/// Reductions themselves are false: their value is per outer index.
std::vector<bool> depends_on_reduced_loops(const Kernel& k, const LoopNest& nest);

/// Per expression: true for a reduction and anything computed from one. A store along the reduced loops whose
/// value is false here can be made in the same walk over the reduced loops as the first reduction.
std::vector<bool> uses_reductions(const Kernel& k);

}  // namespace kiln::fusion
