#pragma once
// Which outputs of a kernel may be written into the storage of one of its inputs. Torch-free.
#include <cstdint>
#include <vector>

#include "fusion/loop_ir.h"

namespace kiln::fusion {

/// Per buffer of `k`: for an output buffer, the index of an input buffer it may overwrite element by element,
/// else -1. That holds when `k` has no reduction, the output has one store, the input has the output's dtype
/// and every load of it is unguarded, reads exactly the index the store writes and is needed by that store or an
/// earlier one (code generators emit each store's operands right before it, so each element is read before it
/// is written, by the same iteration). Whether the input's storage is free to take (its last use, no other
/// alias) is the run plan's question. An input is offered to one output at most.
std::vector<int32_t> in_place_sources(const Kernel& k);

}  // namespace kiln::fusion
