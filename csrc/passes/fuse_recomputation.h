#pragma once
// Recomputed pointwise nodes next to their sibling. A backward graph recomputes cheap pointwise values from
// saved inputs (gelu(h) for the weight gradient of the layer after it) right before the extern call that
// reads them, while a later pointwise node reads the same inputs (gelu_backward(grad, h)). Apart, the two are
// two kernels that each read h; the recomputed node (with the nodes that depend on it) moved right after its
// sibling joins the sibling's kernel (horizontal fusion, one read of h), as torch.compile's fused
// gelu/gelu_backward kernel does.
//
// First, a pointwise node whose first reader is a pointwise node of its shape further down, past an extern call
// (SwiGLU's silu(gate(x)) computed before up(x)'s matmul, then multiplied by it), moves down to just before that
// reader, so that the two share a kernel and the intermediate is not written.
//
// Needs: a verified graph. Guarantees: the same values computed; only deterministic nodes without side effects
// move (pointwise and view nodes, mm/bmm/addmm), never past a node that mutates; a moved node's readers stay
// after it.
#include "graph/graph.h"

namespace kiln::passes {

void fuse_recomputation(graph::Graph& g);

}  // namespace kiln::passes
