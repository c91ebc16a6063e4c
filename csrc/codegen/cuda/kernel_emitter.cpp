// KernelEmitter (kernel_emitter.h): the kernel frame, index arithmetic, expressions and pointwise kernels.
#include "codegen/cuda/kernel_emitter.h"

#include <algorithm>
#include <cstdlib>

#include "codegen/prim_text.h"
#include "common/error.h"

namespace kiln::codegen::cuda {

int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

int64_t pow2_floor(int64_t v) {
  int64_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

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

KernelEmitter::KernelEmitter(const Kernel& k, const graph::Graph& g, bool device_function)
    : k_(k), g_(g), nest_(fusion::build_loop_nest(k)), device_function_(device_function) {
  depends_ = fusion::depends_on_reduced_loops(k, nest_);
  uses_reductions_ = fusion::uses_reductions(k);
  for (const Expr& e : k.exprs) rows_ = rows_ || e.kind == ExprKind::Reduce;
  rows_ = rows_ || nest_.outer_count < static_cast<int>(nest_.loops.size());
  thread_row_ = rows_ && k.window_reduction && nest_.reduced_numel() <= kThreadRowLimit;
  column_ = rows_ && !thread_row_ && column_shaped();
  names_.resize(k.exprs.size());
}

std::string KernelEmitter::emit(CudaKernelLaunch& launch) {
  launch.name = k_.name;
  const int64_t outer = nest_.outer_numel();
  const int64_t reduced = nest_.reduced_numel();
  unsigned threads = kPointwiseBlock;
  if (!rows_) {
    vector_width_ = vector_width();
    launch.strategy = vector_width_ > 1 ? "pointwise_vec" + std::to_string(vector_width_) : "pointwise";
    const int64_t work = (outer + std::max(vector_width_, 1) - 1) / std::max(vector_width_, 1);
    launch.block_x = kPointwiseBlock;
    launch.grid = static_cast<unsigned>(std::min<int64_t>((work + kPointwiseBlock - 1) / kPointwiseBlock, kMaxGrid));
  } else if (thread_row_) {
    launch.strategy = "thread_per_row";
    launch.block_x = kPointwiseBlock;
    launch.grid = static_cast<unsigned>(std::min<int64_t>((outer + kPointwiseBlock - 1) / kPointwiseBlock, kMaxGrid));
  } else if (column_) {
    // 32 outputs per block read whole 128-byte lines, but a bias gradient of 512 columns then fills 16 blocks of
    // an H200's 132 multiprocessors (14 us for 4096 rows, where the copy bound is 3 us). Narrower blocks (8
    // floats still fill a 32-byte sector) with more threads per column keep more of the GPU busy.
    launch.strategy = "column";
    column_vec_ = column_vector_width();
    const int64_t groups = outer / column_vec_;  // each thread's outputs: column_vec_ neighbouring columns
    column_width_ = groups >= 32 * kColumnBlocksWanted ? 32 : groups >= 16 * kColumnBlocksWanted ? 16 : 8;
    launch.block_x = static_cast<unsigned>(column_width_);
    // Threads along the rows: about 16 rows each (with 6, a ViT's 197 rows over 32 threads, the block's
    // shared-memory combine cost a fused producer + sum 86 us where 8 threads per column took 74: H200,
    // 32x197x3072, benchmarks/fused_column_sums_cuda.py; 12 rows over 16 threads made ViT's layer norm weight
    // gradients 28% slower than 25 over 8), more (down to 4 rows each) where there are too few outputs to give
    // kColumnThreadsWanted threads.
    const int64_t by_rows = pow2_floor(std::max<int64_t>(reduced / 16, 1));
    const int64_t by_threads = pow2_ceil((kColumnThreadsWanted + groups - 1) / groups);
    const int64_t most = std::min<int64_t>(1024 / column_width_, pow2_floor(std::max<int64_t>(reduced / 4, 1)));
    launch.block_y = static_cast<unsigned>(std::clamp<int64_t>(std::max(by_rows, by_threads), 1, most));
    launch.grid = static_cast<unsigned>(std::min<int64_t>((groups + column_width_ - 1) / column_width_, kMaxGrid));
    threads = launch.block_x * launch.block_y;
  } else if (reduced <= kWarpRowLimit) {
    launch.strategy = "warp_per_row";
    launch.block_x = 32;
    launch.block_y = kRowsPerBlock;
    launch.grid = static_cast<unsigned>(std::min<int64_t>((outer + kRowsPerBlock - 1) / kRowsPerBlock, kMaxGrid));
    row_vec_ = row_vector_width();
    cached_chunks_ = cached_row_chunks(row_vec_, 32);
  } else {
    launch.strategy = "block_per_row";
    row_vec_ = row_vector_width();
    threads = static_cast<unsigned>(block_row_threads(row_vec_));
    launch.block_x = threads;
    launch.grid = static_cast<unsigned>(std::min<int64_t>(outer, kMaxGrid));
    cached_chunks_ = cached_row_chunks(row_vec_, threads);
  }
  block_reduce_ = launch.strategy == "block_per_row";
  if (cached_chunks_ > 0) launch.strategy += "_cached";
  if (outer == 0) launch.grid = 0;
  index_type_ = needs_64bit_index(launch) ? "long long" : "int";

  std::ostringstream out;
  KILN_ASSERT(!device_function_ || !rows_) << "kernel " << k_.name << ": only pointwise kernels join a launch group";
  out << covers_comment(k_, g_) << "// strategy: " << launch.strategy << "\n";
  if (device_function_)
    out << "__device__ __forceinline__ void ";
  else
    out << "extern \"C\" __global__ void __launch_bounds__(" << (rows_ && !block_reduce_ && !column_ && !thread_row_ ? 32 * kRowsPerBlock : threads)
        << ") ";
  out << k_.name << "(" << parameters(k_);
  if (device_function_) out << ", unsigned kiln_block, unsigned kiln_blocks";
  out << ") {\n";
  out << "  typedef " << index_type_ << " index_t;\n";
  body_ = &out;
  if (outer > 0) {
    if (rows_) emit_rows(outer);
    else emit_pointwise(outer);
  }
  out << "}\n";
  return out.str();
}

bool KernelEmitter::needs_64bit_index(const CudaKernelLaunch& launch) const {
  const int64_t threads = int64_t{launch.grid} * launch.block_x * launch.block_y;
  int64_t largest = nest_.outer_numel() + threads;
  largest = std::max(largest, nest_.reduced_numel() + launch.block_x);
  auto extent = [&](const std::vector<int64_t>& strides, int64_t offset) {
    int64_t e = std::llabs(offset);
    for (size_t l = 0; l < strides.size(); ++l) e += std::llabs(strides[l]) * std::max<int64_t>(nest_.loops[l].size - 1, 0);
    return e;
  };
  for (size_t i = 0; i < k_.exprs.size(); ++i)
    if (k_.exprs[i].kind == ExprKind::Load)
      largest = std::max<int64_t>(largest, extent(nest_.load_strides[i], k_.exprs[i].index.offset) +
                                      std::llabs(k_.exprs[i].gather_stride) * std::max<int64_t>(k_.exprs[i].gather_extent - 1, 0));
  for (size_t s = 0; s < k_.stores.size(); ++s)
    largest = std::max(largest, extent(nest_.store_strides[s], k_.stores[s].index.offset));
  for (size_t i = 0; i < k_.exprs.size(); ++i)
    for (size_t b = 0; b < k_.exprs[i].bounds.size(); ++b)
      largest = std::max(largest, extent(nest_.bound_strides[i][b], k_.exprs[i].bounds[b].index.offset));
  return largest >= kIndex32Limit;
}

int KernelEmitter::vector_width() const {
  const size_t loops = nest_.loops.size();
  if (loops == 0 || k_.scalar_loads_only()) return 1;  // guarded and gathered loads are scalar
  const size_t inner = loops - 1;
  int width = 8;
  bool any = false;
  std::vector<std::pair<const std::vector<int64_t>*, int64_t>> contiguous;  // strides, offset
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    const Expr& e = k_.exprs[i];
    if (e.kind != ExprKind::Load) continue;
    const int64_t stride = nest_.load_strides[i][inner];
    if (stride != 0 && stride != 1) return 1;
    if (stride != 1) continue;
    width = std::min(width, 16 / type_info(k_.buffers[e.buffer].dtype).bytes);
    contiguous.push_back({&nest_.load_strides[i], e.index.offset});
    any = true;
  }
  for (size_t s = 0; s < k_.stores.size(); ++s) {
    if (nest_.store_strides[s][inner] != 1) return 1;
    width = std::min(width, 16 / type_info(k_.buffers[k_.stores[s].buffer].dtype).bytes);
    contiguous.push_back({&nest_.store_strides[s], k_.stores[s].index.offset});
    any = true;
  }
  if (!any || width < 2) return 1;
  if (loops == 1) return width;
  for (; width >= 2; width /= 2) {
    bool fits = nest_.loops[inner].size % width == 0;
    for (const auto& [strides, offset] : contiguous) {
      fits = fits && offset % width == 0;
      for (size_t l = 0; l < inner; ++l) fits = fits && (*strides)[l] % width == 0;
    }
    if (fits) return width;
  }
  return 1;
}

void KernelEmitter::decompose(const std::string& flat, int first, int last, const std::string& indent) {
  if (last <= first) return;
  if (last - first == 1) {
    *body_ << indent << "const index_t i" << first << " = " << flat << ";\n";
    return;
  }
  const std::string rest = "rest" + std::to_string(first);
  *body_ << indent << "index_t " << rest << " = " << flat << ";\n";
  for (int l = last - 1; l > first; --l)
    *body_ << indent << "const index_t i" << l << " = " << rest << " % " << nest_.loops[l].size << "; " << rest << " /= "
           << nest_.loops[l].size << ";\n";
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
      if (lane_ >= 0 && nest_.load_strides[e][lane_axis] == 1)
        return "kiln::load(lv" + std::to_string(e) + ".v[" + std::to_string(lane_) + "])";
      std::string address = index(nest_.load_strides[e], x.index.offset);
      if (x.operands[1] >= 0)  // gathered: the index value, checked (a trap, as eager's device-side assert), times its stride
        address += " + static_cast<index_t>(kiln::gather_index(" + name(1) + ", " + std::to_string(x.gather_extent) + "ll)) * " +
                   std::to_string(x.gather_stride);
      const std::string load = "kiln::load(" + buffer + "[" + address + "])";
      return x.operands[0] < 0 ? load : guarded_load_text(name(0), load, x.constant, x.dtype);
    }
    case ExprKind::InBounds:
      return in_bounds_text(x, nest_.bound_strides[e]);
    case ExprKind::Constant:
      return literal(x.constant, x.dtype);
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
  out << "  const index_t n = " << n << ";\n";
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
  if (vector_width_ <= 1) {
    scalar_loop("first", "  ");
    return;
  }
  const int v = vector_width_;
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
    out << indent << "const " << vec_type(e.buffer) << " lv" << i << " = *reinterpret_cast<const " << vec_type(e.buffer)
        << "*>(buf" << e.buffer << " + " << index(nest_.load_strides[i], e.index.offset) << ");\n";
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
    checks.push_back("kiln::aligned_to(buf" + std::to_string(buffer) + " + " + std::to_string(offset) + ", sizeof(" +
                     vec_type(buffer, width) + "))");
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
