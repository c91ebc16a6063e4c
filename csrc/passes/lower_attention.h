#pragma once
// scaled_dot_product_attention in graphs that need grad, as a kernel with a backward; and its boolean masks as
// additive biases in graphs that do not. Torch-free.
//
// The tracer records scaled_dot_product_attention whole, so the run picks flash, memory-efficient or cuDNN
// attention as eager does. That op has no backward of its own: each of its kernels saves its own statistics
// for one. Before the joint graph is built (autodiff/build_joint_graphs), each such node whose arguments a
// differentiable kernel accepts becomes that kernel, with the results its backward reads (the logsumexp): on CUDA
// _scaled_dot_product_efficient_attention (the kernel eager picks there for float32 and for any masked attention),
// on CPU _scaled_dot_product_flash_attention_for_cpu (eager's CPU kernel). A mask becomes the kernels' additive bias
// as ATen makes it: a boolean one 0 where True and -inf where False in the query's dtype, broadcast to (batch,
// heads, length, key length), and on CUDA written into rows padded to 16 elements where its strides are not
// multiples of 16 (what the memory-efficient kernels read). Other nodes (dropout on CPU, grouped-query attention, a
// mask with is_causal, of another dtype or needing grad, shapes the kernels refuse) are left alone: autodiff
// differentiates them with the math, or reports them and the graph runs on the eager interpreter.
#include "graph/graph.h"
#include "graph/op_oracle.h"

namespace kiln::passes {

/// Needs: `g` a captured graph; `oracle` answers the metas of the kernel ops named above. Rewrites each attention
/// node as above. Guarantees: the attention output keeps its value id and recorded meta (the runtime conforms the
/// real layout: runtime/node_call), the kernel's other results and the bias's nodes are new values that do not
/// require grad, and no value is renumbered (the bias's nodes are inserted before the attention).
void lower_attention_for_autodiff(graph::Graph& g, graph::OpOracle& oracle);

/// Needs: `g` a graph that needs no grad. Each float32 CUDA scaled_dot_product_attention node with a boolean mask
/// (no is_causal, no grouped-query heads) reads the additive bias ATen would make of that mask (as above, aligned for
/// the memory-efficient kernels) instead, built once per mask in the graph: ATen converts a boolean mask at every call
/// (for a 12-layer model, 12 conversions of one mask, and their launches), where the bias built here is one fused
/// kernel. The attention stays whole, so the run picks its kernel as eager does (for float32 with a mask, the
/// memory-efficient one, or the math). Returns true if some node changed.
bool attention_masks_as_biases(graph::Graph& g, graph::OpOracle& oracle);
/// Whether attention_masks_as_biases has a node to change in `g`.
bool has_attention_mask_to_convert(const graph::Graph& g);

}  // namespace kiln::passes
