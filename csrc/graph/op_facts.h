#pragma once
// What kiln knows about ATen op overloads, in one table (graph/op_facts.cpp): a row per op, its facts as named
// fields, which passes, autodiff and runtime read instead of keeping their own lists of op names.
//
// Facts are conservative. A field left at its default means that nothing in kiln relies on that fact for the op,
// not that the op lacks it: mm is free of side effects, but only the ops dead-node removal was taught to drop say
// so. Setting a fact changes what every reader of that field does with the op, so each one is a decision made in
// its row, and the comment on the field names its readers.
//
// Not here: whether an op is differentiable (autodiff's derivative-rule table: autodiff::find_derivative_rule)
// and how it is written in prims (decomp/'s decomposition table); both are registrations by op name.
//
// Torch-free.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::graph {

/// What having the op's result again costs, for the passes that recompute or move nodes.
enum class OpCost : uint8_t {
  kUnknown,
  // A view of its only tensor argument: the backward redoes it on that base rather than having the forward return
  // (and keep alive) one more aliasing tensor (autodiff/backward_builder, autodiff/partition).
  kView,
  // Elementwise and cheap (casts and copies too): the backward may redo it from its operands (autodiff/partition).
  kPointwise,
  // An extern matrix product: deterministic and free of side effects (passes/fuse_recomputation may move it).
  kMatmul,
};

/// How the op's output layout follows its inputs' (passes/channels_last, runtime/node_call).
enum class OpLayout : uint8_t {
  kUnknown,              // a channels-last input is given back in its recorded layout first
  kFollowsOperands,      // 4-d outputs like the input, channels-last when all operands shaped like them are
  // 4-d outputs take the first operand's layout whatever its shape: ATen's CUDA pooling kernels have channels-last
  // variants, constant_pad_nd allocates its output in its input's suggested layout, and kiln's generated pooling and
  // padding kernels index any layout.
  kFollowsFirstOperand,
  kBatchNorm,  // output 0 follows the input's layout; the others are per-channel vectors
  // The kernel ATen picks at run time (attention: flash, memory-efficient, math) and its inputs' layouts decide, so
  // the recorded strides may differ from the run's: runtime/node_call copies such outputs into the recorded layout.
  kChosenByKernel,
};

/// Views kiln's kernels load through without a copy (decomp::is_affine_view).
enum class OpView : uint8_t {
  kNone,
  kAffine,                // the output is an affine re-indexing of argument 0's storage
  kAffineWhenContiguous,  // reshape-like: affine when input and output are contiguous
};

/// Ops that give their input new sizes, keeping its elements in order (passes/split_addmm, passes/stage_row_sums).
enum class OpReshape : uint8_t {
  kNone,
  kView,     // always a view (view, _unsafe_view)
  kMayCopy,  // a view when the input allows one, else a copy (reshape)
};

/// Tensors an op creates without reading tensor values (passes/fold_constants, passes/remove_dead_nodes).
enum class OpCreates : uint8_t {
  kNothing,
  kFill,        // filled with a number: fusion writes the fill inside its readers' kernels
  kAllocation,  // uninitialised memory
};

/// Whether passes/functionalize_buffer_updates may replace the in-place op on a graph input (a buffer update
/// such as BatchNorm's num_batches_tracked.add_(1)) by its functional twin and a write-back.
enum class OpBufferUpdate : uint8_t {
  kNo,
  kYes,
  kFloatingOnly,  // only on a floating tensor: the functional op would promote an integer one (true division)
};

struct OpFacts {
  std::string_view name;  // "aten::add.Tensor", as Node::qualified_name() spells it
  OpCost cost = OpCost::kUnknown;
  OpLayout layout = OpLayout::kUnknown;
  OpView view = OpView::kNone;
  OpReshape reshape = OpReshape::kNone;
  OpCreates creates = OpCreates::kNothing;
  /// Draws from a generator: never recomputed, since the backward would draw other numbers (autodiff/partition).
  bool random = false;
  /// An extern whose result depends on its arguments alone: constant folding may run it once (passes/fold_constants).
  bool deterministic = false;
  /// An extern that does nothing but compute its result: dead-node removal may drop it (passes/remove_dead_nodes).
  bool side_effect_free = false;
  /// `x op y` over two broadcast tensors, its result laid out like them as eager's TensorIterator does: the op may
  /// move past a permuting copy, its operands read through strided views (passes/sink_into_copies).
  bool elementwise_binary = false;
  /// The number c for which `op(x, c)` is x (mul, div, pow: 1; sub: 0) (passes/simplify_algebra).
  std::optional<double> right_identity;

  // In-place ops.
  /// The functional twin: same arguments, the result in a new tensor ("aten::relu_.default" -> "aten::relu.default";
  /// a view for in-place views such as t_) (passes/functionalize, passes/functionalize_buffer_updates).
  std::string_view functional;
  /// Its other tensor operands (indices, masks, sources cast on store) do not decide the result's dtype, so any
  /// dtype may stand there when the op is made functional (passes/functionalize).
  bool any_operand_dtype = false;
  OpBufferUpdate buffer_update = OpBufferUpdate::kNo;
  /// Writes arguments that never require grad, and nothing else (training-mode BatchNorm's running statistics): its
  /// derivative rule is still exact and the forward replays the write (autodiff/build_joint_graphs); a graph input it
  /// writes shares storage with it, so no buffer update of that input is made functional
  /// (passes/functionalize_buffer_updates).
  bool mutates_only_buffers = false;
};

/// The row of `qualified_name` ("aten::sigmoid.default"); for an op without one, a row of defaults (nothing known).
const OpFacts& op_facts(std::string_view qualified_name);
/// Every row, in the table's order (for tests and listings).
const std::vector<OpFacts>& all_op_facts();
/// "aten::relu.default" -> {"aten::relu", "default"}: Node::op and Node::overload.
std::pair<std::string, std::string> split_qualified_name(std::string_view qualified_name);

}  // namespace kiln::graph
