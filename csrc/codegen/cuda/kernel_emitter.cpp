// KernelEmitter (kernel_emitter.h): the kernel frame, index arithmetic, expressions and pointwise kernels, rendered
// from the kernel's CudaKernelSchedule.
#include "codegen/cuda/kernel_emitter.h"

#include <algorithm>

#include "codegen/prim_text.h"
#include "common/error.h"

namespace kiln::codegen::cuda {

std::string covers_comment(const Kernel& k, const graph::Graph& g) {
  std::ostringstream out;
  out << "// " << k.name << " covers graph nodes:";
  for (graph::NodeIndex n : k.nodes) out << " " << n << ":" << g.nodes[n].qualified_name();
  out << "\n";
  return out.str();
}

std::string parameters(const Kernel& k, const std::string& prefix, size_t first) {
  std::string text;
  for (size_t b = 0; b < k.buffers.size(); ++b) {
    const auto& buf = k.buffers[b];
    text += std::string(b ? ", " : "") + (buf.is_output ? "" : "const ") + storage_type(buf.dtype) + "* __restrict__ " +
            prefix + std::to_string(first + b);
  }
  return text;
}

KernelEmitter::KernelEmitter(const KernelAnalysis& analysis, const CudaKernelSchedule& schedule, const graph::Graph& g,
                             bool device_function, bool size_arguments)
    : k_(analysis.kernel), g_(g), a_(analysis), nest_(analysis.nest), depends_(analysis.depends),
      uses_reductions_(analysis.uses_reductions), schedule_(schedule), device_function_(device_function),
      sizes_(size_arguments), cached_chunks_(schedule.cached_row_chunks) {
  KILN_ASSERT(!(device_function && size_arguments)) << "kernel " << k_.name << ": a launch group member with size arguments";
  names_.resize(k_.exprs.size());
}

std::string KernelEmitter::emit(CudaKernelLaunch& launch) {
  launch.name = k_.name;
  launch.strategy = strategy_name(schedule_);
  launch.grid = schedule_.grid;
  launch.block_x = schedule_.block_x;
  launch.block_y = schedule_.block_y;
  const int64_t outer = nest_.outer_numel();
  const bool pointwise = is(CudaKernelKind::Pointwise);

  std::ostringstream out;
  KILN_ASSERT(!device_function_ || pointwise) << "kernel " << k_.name << ": only pointwise kernels join a launch group";
  out << covers_comment(k_, g_) << "// strategy: " << launch.strategy << "\n";
  if (device_function_)
    out << "__device__ __forceinline__ void ";
  else
    out << "extern \"C\" __global__ void __launch_bounds__(" << schedule_.threads_per_block() << ") ";
  // The body first: with size arguments, the parameter list and the slots' declarations depend on it.
  std::ostringstream body;
  body_ = &body;
  if (outer > 0) {
    if (pointwise) emit_pointwise(outer);
    else emit_rows(outer);
  }
  const std::vector<int64_t>& slots = sizes_.values();
  out << k_.name << "(" << parameters(k_);
  if (device_function_) out << ", unsigned kiln_block, unsigned kiln_blocks";
  if (!slots.empty()) out << ", const kiln_sizes<" << slots.size() << "> sizes";
  out << ") {\n";
  out << "  typedef " << (schedule_.index_64bit ? "long long" : "int") << " index_t;\n";
  // Each slot read once, at the index width the schedule chose for this binding (every size fits it).
  for (size_t k = 0; k < slots.size(); ++k)
    out << (k % 4 == 0 ? "  const index_t " : ", ") << sizes_.prefix() << k << " = static_cast<index_t>(sizes.v[" << k
        << "])" << (k % 4 == 3 || k + 1 == slots.size() ? ";\n" : "");
  out << body.str() << "}\n";
  launch.sizes = slots;
  return out.str();
}

void KernelEmitter::decompose(const std::string& flat, int first, int last, const std::string& indent) {
  if (last <= first) return;
  if (last - first == 1) {
    *body_ << indent << "const index_t i" << first << " = " << flat << ";\n";
    return;
  }
  const std::string rest = "rest" + std::to_string(first);
  *body_ << indent << "index_t " << rest << " = " << flat << ";\n";
  for (int l = last - 1; l > first; --l) {
    const std::string extent = size(nest_.loops[l].size);
    *body_ << indent << "const index_t i" << l << " = " << rest << " % " << extent << "; " << rest << " /= " << extent
           << ";\n";
  }
  *body_ << indent << "const index_t i" << first << " = " << rest << ";\n";
}

std::string KernelEmitter::expression(int32_t e) const {
  const Expr& x = k_.exprs[e];
  const std::string ct = compute_type(x.dtype);
  auto name = [&](int i) { return names_[x.operands[i]]; };
  switch (x.kind) {
    case ExprKind::Load: {
      const std::string buffer = "buf" + std::to_string(x.buffer);
      const size_t lane_axis = column_lanes_ ? static_cast<size_t>(nest_.outer_count - 1) : nest_.load_strides[e].size() - 1;
      if (lane_ >= 0 && nest_.load_strides[e][lane_axis] == 1) {
        // a guarded vector was loaded only where its guard holds (the same for all its lanes: pointwise_vector_width)
        const std::string lane_load = "kiln::load(lv" + std::to_string(e) + ".v[" + std::to_string(lane_) + "])";
        return x.operands[0] < 0 ? lane_load : guarded_load_text(name(0), lane_load, x.constant, x.dtype);
      }
      std::string address = index(nest_.load_strides[e], x.index.offset);
      if (x.operands[1] >= 0)  // gathered: the index value, checked (a trap, as eager's device-side assert), times its stride
        address += " + static_cast<index_t>(kiln::gather_index(" + name(1) + ", " +
                   sizes_(x.gather_extent, std::to_string(x.gather_extent) + "ll") + ")) * " +
                   sizes_.stride(x.gather_stride, std::to_string(x.gather_stride));
      const std::string load = "kiln::load(" + buffer + "[" + address + "])";
      return x.operands[0] < 0 ? load : guarded_load_text(name(0), load, x.constant, x.dtype);
    }
    case ExprKind::Iota: {
      // In vector code the loop variables name the vector's first element: lane `lane_` is that many steps on.
      const std::vector<int64_t>& strides = nest_.load_strides[e];
      const size_t lane_axis = column_lanes_ ? static_cast<size_t>(nest_.outer_count - 1) : strides.size() - 1;
      std::string value = "static_cast<long long>(" + index(strides, x.index.offset) + ")";
      if (lane_ > 0 && !strides.empty() && strides[lane_axis] != 0)
        value = "(" + value + " + " + std::to_string(lane_) + "LL * " +
                sizes_.stride(strides[lane_axis], std::to_string(strides[lane_axis])) + ")";
      return value;
    }
    case ExprKind::InBounds:
      return in_bounds_text(x, nest_.bound_strides[e], sizes_);
    case ExprKind::Constant: {
      const std::string slot = sizes_.constant(k_, e, ct);
      return slot.empty() ? literal(x.constant, x.dtype) : slot;
    }
    case ExprKind::Cast: {
      const ScalarType from = k_.exprs[x.operands[0]].dtype;
      // A 16-bit value computed in float is rounded where eager would have stored it, at an explicit
      // cast out of its dtype (`x.half() * 3).float()`): loads are exact already.
      std::string operand = name(0);
      const bool exact = k_.exprs[x.operands[0]].kind == ExprKind::Load || k_.exprs[x.operands[0]].kind == ExprKind::Cast;
      if (from == ScalarType::Half && x.dtype != ScalarType::Half && !exact) operand = "kiln::round_half(" + operand + ")";
      if (from == ScalarType::BFloat16 && x.dtype != ScalarType::BFloat16 && !exact) operand = "kiln::round_bf16(" + operand + ")";
      if (x.dtype == ScalarType::Bool) return "(" + operand + " != 0)";
      const std::string converted = "static_cast<" + ct + ">(" + operand + ")";
      const bool narrows = from == ScalarType::Float || from == ScalarType::Double || !graph::is_floating_or_complex(from);
      if (x.dtype == ScalarType::BFloat16 && narrows) return "kiln::round_bf16(" + converted + ")";
      if (x.dtype == ScalarType::Half && narrows) return "kiln::round_half(" + converted + ")";
      return converted;
    }
    case ExprKind::Unary:
    case ExprKind::Binary:
    case ExprKind::Where: {
      return fill_prim_format(prim_format(x.kind == ExprKind::Where ? PrimOp::Where : x.op), x,
                              compute_type(k_.exprs[typed_operand(x)].dtype), names_);
    }
    case ExprKind::Reduce:
      break;
  }
  KILN_ASSERT(false) << "kernel " << k_.name << ": expression " << e << " cannot be emitted inline";
  return "";
}

void KernelEmitter::emit_expr(int32_t e, const std::string& indent) {
  if (!names_[e].empty()) return;
  const Expr& x = k_.exprs[e];
  KILN_ASSERT(x.kind != ExprKind::Reduce) << "kernel " << k_.name << ": reduction " << e << " used before it is computed";
  for (int32_t op : x.operands)
    if (op >= 0) emit_expr(op, indent);
  names_[e] = "v" + std::to_string(e) + (lane_ >= 0 ? "_" + std::to_string(lane_) : "");
  *body_ << indent << "const " << compute_type(x.dtype) << " " << names_[e] << " = " << expression(e) << ";\n";
  scope_.push_back(e);
}

void KernelEmitter::forget_scope() {
  for (int32_t id : scope_) names_[id].clear();
  scope_.clear();
}

std::string KernelEmitter::store_text(size_t s, const std::string& value, bool scalar_index) const {
  const auto& st = k_.stores[s];
  const std::string target = "buf" + std::to_string(st.buffer) + "[" +
                             (scalar_index ? index(nest_.store_strides[s], st.index.offset) : "") + "]";
  return target + " = kiln::store_as<" + storage_type(k_.buffers[st.buffer].dtype) + ">::from(" + value + ");";
}

void KernelEmitter::emit_scalar_element(const std::string& indent) {
  for (size_t s = 0; s < k_.stores.size(); ++s) {
    emit_expr(k_.stores[s].expr, indent);
    *body_ << indent << store_text(s, names_[k_.stores[s].expr], true) << "\n";
  }
  forget_scope();
}

void KernelEmitter::emit_pointwise(int64_t n) {
  std::ostream& out = *body_;
  out << "  const index_t n = " << size(n) << ";\n";
  const char* block = device_function_ ? "kiln_block" : "blockIdx.x";
  const char* blocks = device_function_ ? "kiln_blocks" : "gridDim.x";
  out << "  const index_t first = static_cast<index_t>(" << block << ") * blockDim.x + threadIdx.x;\n";
  out << "  const index_t step = static_cast<index_t>(" << blocks << ") * blockDim.x;\n";
  // The grid covers the work (kMaxGrid blocks: up to 2^28 threads), so each thread runs a grid-stride loop about
  // once: `unroll 1` keeps NVVM from unrolling it 4x, which made the pointwise program a third slower to compile.
  const int outer = nest_.outer_count;
  auto scalar_loop = [&](const std::string& start, const std::string& indent) {
    out << indent << "#pragma unroll 1\n" << indent << "for (index_t flat = " << start << "; flat < n; flat += step) {\n";
    decompose("flat", 0, outer, indent + "  ");
    emit_scalar_element(indent + "  ");
    out << indent << "}\n";
  };
  if (schedule_.vector_width <= 1) {
    scalar_loop("first", "  ");
    return;
  }
  const int v = schedule_.vector_width;
  auto vec_type = [&](int buffer) { return this->vec_type(buffer, v); };
  auto contiguous_load = [&](size_t i) { return k_.exprs[i].kind == ExprKind::Load && nest_.load_strides[i].back() == 1; };
  out << "  const bool aligned = " << alignment_test(v) << ";\n  if (aligned) {\n";
  out << "    const index_t vectors = n / " << v << ";\n";
  out << "    #pragma unroll 1\n    for (index_t vi = first; vi < vectors; vi += step) {\n";
  const std::string indent = "      ";
  decompose("vi * " + std::to_string(v), 0, outer, indent);  // the indices of the vector's first element
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    if (!contiguous_load(i)) continue;
    const Expr& e = k_.exprs[i];
    const std::string load = "*reinterpret_cast<const " + vec_type(e.buffer) + "*>(buf" + std::to_string(e.buffer) + " + " +
                             index(nest_.load_strides[i], e.index.offset) + ")";
    // a guarded vector (a padded read) is read only inside its operand: its guard (bounds, or a conjunction of them
    // for a recomputed producer's own padded read), at the vector's first element, holds for every lane or for none
    if (e.operands[0] >= 0) emit_expr(e.operands[0], indent);
    const std::string value =
        e.operands[0] < 0 ? load : "(" + names_[e.operands[0]] + " ? " + load + " : " + vec_type(e.buffer) + "{})";
    out << indent << "const " << vec_type(e.buffer) << " lv" << i << " = " << value << ";\n";
  }
  for (size_t s = 0; s < k_.stores.size(); ++s) out << indent << vec_type(k_.stores[s].buffer) << " sv" << s << ";\n";
  for (lane_ = 0; lane_ < v; ++lane_) {
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      emit_expr(k_.stores[s].expr, indent);
      out << indent << "sv" << s << ".v[" << lane_ << "] = kiln::store_as<" << storage_type(k_.buffers[k_.stores[s].buffer].dtype)
          << ">::from(" << names_[k_.stores[s].expr] << ");\n";
    }
    forget_scope();
  }
  lane_ = -1;
  for (size_t s = 0; s < k_.stores.size(); ++s)
    out << indent << "*reinterpret_cast<" << vec_type(k_.stores[s].buffer) << "*>(buf" << k_.stores[s].buffer << " + "
        << index(nest_.store_strides[s], k_.stores[s].index.offset) << ") = sv" << s << ";\n";
  out << "    }\n";
  scalar_loop("vectors * " + std::to_string(v) + " + first", "    ");
  out << "  } else {\n";
  scalar_loop("first", "    ");
  out << "  }\n";
}

std::string KernelEmitter::vec_type(int buffer, int width) const {
  return "kiln::vec<" + std::string(storage_type(k_.buffers[buffer].dtype)) + ", " + std::to_string(width) + ">";
}

std::string KernelEmitter::alignment_test(int width, int axis) const {
  const size_t along = axis < 0 ? nest_.loops.size() - 1 : static_cast<size_t>(axis);
  std::vector<std::string> checks;
  auto check = [&](int buffer, int64_t offset) {
    checks.push_back("kiln::aligned_to(buf" + std::to_string(buffer) + " + " + sizes_.stride(offset, std::to_string(offset)) +
                     ", sizeof(" + vec_type(buffer, width) + "))");
  };
  for (size_t i = 0; i < k_.exprs.size(); ++i)
    if (k_.exprs[i].kind == ExprKind::Load && nest_.load_strides[i][along] == 1) check(k_.exprs[i].buffer, k_.exprs[i].index.offset);
  for (size_t s = 0; s < k_.stores.size(); ++s)
    if (nest_.store_strides[s][along] == 1) check(k_.stores[s].buffer, k_.stores[s].index.offset);
  std::sort(checks.begin(), checks.end());
  checks.erase(std::unique(checks.begin(), checks.end()), checks.end());
  std::string test;
  for (const std::string& c : checks) test += (test.empty() ? "" : " && ") + c;
  return test.empty() ? "true" : test;
}

}  // namespace kiln::codegen::cuda
