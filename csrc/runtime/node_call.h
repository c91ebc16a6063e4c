#pragma once
// Calling one graph node through the c10 dispatcher, shared by the eager interpreter and the extern calls
// of compiled graphs (runtime/kernel_graph.cpp): everything that does not depend on the call's tensors
// (OperatorHandle, non-tensor arguments as IValues, constant tensors) is prepared once.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace kiln::runtime {

/// The c10 device a graph's device names (graph::DeviceType follows c10::DeviceType's numbering).
inline c10::Device to_c10(const graph::Device& d) { return c10::Device(static_cast<c10::DeviceType>(d.type), d.index); }

struct PreparedNode {
  // A stack position filled per call with one tensor.
  struct TensorSlot {
    int32_t position;
    graph::ValueId id;
  };
  // A stack position filled per call with a Tensor[] / Tensor?[] built from values.
  struct TensorListSlot {
    int32_t position;
    bool optional_elements;  // Tensor?[] (c10::List<std::optional<Tensor>>)
    std::vector<std::optional<graph::ValueId>> ids;
  };
  std::optional<c10::OperatorHandle> op;  // unset for kiln's own ops (kiln::set_grad_enabled), which node_call.cpp runs itself
  std::string name;                       // "aten::addmm.default", for error messages
  std::vector<c10::IValue> stack_template;
  std::vector<TensorSlot> tensor_slots;
  std::vector<TensorListSlot> list_slots;
  // aten::copy (a functionalized `copy_` on an intermediate) has no autograd formula in PyTorch: with grad on,
  // call_node runs it as eager did, a copy_ into a fresh tensor of self's layout (the gradient goes to src).
  bool copy_into_fresh = false;
  // Positions of outputs that call_node copies into their recorded layout when ATen returns another (see
  // restore_recorded_layout).
  std::vector<size_t> restored_outputs;
  std::vector<graph::ValueId> outputs;
  bool returns_list = false;
  // The op's out= overload (aten::mm.out for aten::mm.default), set by prepare_out_variant: its arguments are
  // the op's, then one `out` tensor per return.
  std::optional<c10::OperatorHandle> out_op;
};

/// Looks up the node's operator and converts its constant arguments. `constants[id]` is the real tensor of
/// constant value `id`. Unknown ops or argument lists that do not match the schema raise an error naming
/// the node.
PreparedNode prepare_node(const graph::Graph& g, const graph::Node& node, const std::vector<at::Tensor>& constants);

/// Makes call_node copy output `position` of `node` into its recorded strides whenever ATen lays it out otherwise
/// (a differentiable copy). prepare_node asks it for scaled_dot_product_attention, whose output is recorded in the
/// fused kernels' layout (kiln/_fake.py) that the views after it were recorded against; the kiln backend asks it
/// for extern outputs its kernels read with the recorded strides baked in.
void restore_recorded_layout(PreparedNode& node, size_t position);

/// The node's arguments as its op takes them (stack_template with the tensors of `env` filled in; constants read
/// from `constants`), for callers that run the op some other way (kiln's meta rules: compile/meta_oracle.cpp).
std::vector<c10::IValue> argument_stack(const PreparedNode& node, const graph::Graph& g,
                                        const std::vector<at::Tensor>& constants, const std::vector<at::Tensor>& env);

/// Finds the out= overload of a node with one output (the op's arguments followed by an out tensor, returning it)
/// and keeps it in `node.out_op`. False, leaving the node as it was, for other nodes, ops without one, and ops whose
/// out= overload only copies the functional op's result into `out` (torchgen's autogen wrappers).
bool prepare_out_variant(PreparedNode& node);

/// Like call_node, through the out= overload prepare_out_variant found: the results are written into `outs` (one
/// per output, laid out as the graph records them), which become the outputs in `env`.
void call_node_into(const PreparedNode& node, const graph::Graph& g, const std::vector<at::Tensor>& constants,
                    std::vector<at::Tensor>& env, std::vector<at::Tensor> outs);

/// Calls the op at the top of the dispatcher (autograd and every other key behave as in eager) with the
/// tensors of `env` (indexed by ValueId; constants read from `constants`), and stores its results in `env`.
void call_node(const PreparedNode& node, const graph::Graph& g, const std::vector<at::Tensor>& constants,
               std::vector<at::Tensor>& env);

}  // namespace kiln::runtime
