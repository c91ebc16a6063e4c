#pragma once
// The pipeline's step after constant folding (compile/pipeline.cpp): an attention mask that masks nothing is dropped,
// so that the unmasked attention kernels and their backward apply. Here, in runtime/, because deciding needs the
// mask's real values (computed through the dispatcher, as evaluate_folding.h computes folded values) and because the
// C++ loader of exported programs (csrc/export), which links no Python and no compile/, repeats the pipeline's steps
// before its cache key to find the graph the saved artefact was made from.
#include <memory>

#include "graph/graph.h"
#include "runtime/kernel_graph.h"

namespace kiln::runtime {

/// scaled_dot_product_attention whose mask reads no graph input and masks nothing (all True, or all 0.0: what
/// transformers builds from an all-ones attention mask while compiling) gets no mask; the result is the same. A mask
/// that is not a constant yet (a fill such as torch.ones, which folding leaves as a node) is computed from the
/// constants alone (passes::plan_value_folding). `constants_of` gives the real tensors of `g`'s constants, indexed by
/// ValueId; it is called only when some attention has a mask. Returns `g` itself when no mask qualifies, or when
/// computing one fails (logged under `fallbacks`). Value ids are unchanged: only the attention nodes' arguments are.
std::shared_ptr<const graph::Graph> drop_attention_masks_that_mask_nothing(std::shared_ptr<const graph::Graph> g,
                                                                            const ConstantsOf& constants_of);

}  // namespace kiln::runtime
