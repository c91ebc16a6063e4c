// CUDA C code generation from the loop IR.
//
// Design: the kernel's domain is turned into loops (fusion/loop_nest.h), then one of three shapes:
// - pointwise (no reduction): one thread per element in a grid-stride loop over the flat outer index, which
//   is split back into loop indices with constant divisors. When the nest is one contiguous loop, each
//   thread moves 16 bytes per access (`kiln::vec`, ld.global.v4) after a run-time alignment test, with a
//   scalar loop for the tail and for unaligned views.
// - warp_per_row: reductions over at most kWarpRowLimit elements; a warp owns a row (8 rows per block), each
//   lane strides over the row, the lanes combine with register shuffles.
// - block_per_row: longer rows; a block owns a row and combines through shared memory (kiln_reduce.cuh).
// - thread_per_row: pooling windows (fusion's window reductions of at most kThreadRowLimit elements): one
//   thread per output, like a pointwise kernel, walking its window serially; neighbouring threads take
//   neighbouring outputs, so channels-last reads are coalesced. A warp per 9-element window idled 23 lanes.
// - column: reductions whose inputs are contiguous along the outputs rather than along the reduced dims (a
//   bias gradient, a sum over the batch dim): 32 neighbouring outputs per block, one per threadIdx.x, so each
//   warp reads 32 consecutive elements; threadIdx.y splits the reduced range, combined in shared memory.
// In both row shapes the body mirrors the C++ generator: per row, each reduction in its own pass over the
// reduced loops (recomputing the pointwise prologue it needs), then the per-row values and stores (lane 0),
// then one more pass for stores that run along the reduced loops (softmax's output, layer norm's y). Rows are
// re-read from L1/L2 rather than held in registers; a persistent register-resident variant is future work.
// Index arithmetic is 32-bit when every index a kernel forms stays below 2^30, else 64-bit.
#include "codegen/cuda/emit_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <unordered_map>

#include "codegen/cuda/cuda_text.h"
#include "codegen/prim_text.h"
#include "common/error.h"
#include "fusion/loop_nest.h"

namespace kiln::codegen::cuda {

using decomp::PrimOp;
using decomp::ReduceOp;
using fusion::Expr;
using fusion::ExprKind;
using fusion::Kernel;
using graph::ScalarType;

namespace {

constexpr unsigned kPointwiseBlock = 256;
constexpr unsigned kRowsPerBlock = 8;       // warp_per_row: one warp per row, 8 warps per block
constexpr int64_t kWarpRowLimit = 512;      // rows up to this long reduce within one warp
constexpr int64_t kThreadRowLimit = 64;     // pooling windows up to this size are walked by one thread
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int64_t kIndex32Limit = (int64_t{1} << 31) - 1;
// A graph's kernels are split into up to kMaxParts NVRTC programs of about kKernelsPerPart distinct kernels,
// compiled in parallel: NVRTC's time grows with the program, and resnet50's one program took ~3 s.
constexpr int kKernelsPerPart = 4;
constexpr int kMaxParts = 8;


int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

// "// kernel_3_add covers graph nodes: 4:aten::add.Tensor ...": the same line as the C++ generator's, which
// tools read to map kernels back to graph nodes.
std::string covers_comment(const Kernel& k, const graph::Graph& g) {
  std::ostringstream out;
  out << "// " << k.name << " covers graph nodes:";
  for (graph::NodeIndex n : k.nodes) out << " " << n << ":" << g.nodes[n].qualified_name();
  out << "\n";
  return out.str();
}

// A kernel's parameter list: one pointer per buffer, `buf<i>`, or `<prefix><i>` (const for inputs).
std::string parameters(const Kernel& k, const std::string& prefix = "buf", size_t first = 0) {
  std::string text;
  for (size_t b = 0; b < k.buffers.size(); ++b) {
    const auto& buf = k.buffers[b];
    text += std::string(b ? ", " : "") + (buf.is_output ? "" : "const ") + storage_type(buf.dtype) + "* __restrict__ " +
            prefix + std::to_string(first + b);
  }
  return text;
}

class KernelEmitter {
 public:
  // device_function: a pointwise kernel emitted as a __device__ function of a launch group, taking its block
  // index and block count within the group as its last two parameters (kiln_block, kiln_blocks).
  KernelEmitter(const Kernel& k, const graph::Graph& g, bool device_function = false)
      : k_(k), g_(g), nest_(fusion::build_loop_nest(k)), device_function_(device_function) {
    depends_ = fusion::depends_on_reduced_loops(k, nest_);
    for (const Expr& e : k.exprs) rows_ = rows_ || e.kind == ExprKind::Reduce;
    rows_ = rows_ || nest_.outer_count < static_cast<int>(nest_.loops.size());
    thread_row_ = rows_ && k.window_reduction && nest_.reduced_numel() <= kThreadRowLimit;
    column_ = rows_ && !thread_row_ && column_shaped();
    names_.resize(k.exprs.size());
  }

  std::string emit(CudaKernelLaunch& launch) {
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
      launch.strategy = "column";
      launch.block_x = 32;
      launch.block_y = static_cast<unsigned>(std::clamp<int64_t>(pow2_ceil((reduced + 7) / 8), 1, 32));
      launch.grid = static_cast<unsigned>(std::min<int64_t>((outer + 31) / 32, kMaxGrid));
      threads = 32 * launch.block_y;
    } else if (reduced <= kWarpRowLimit) {
      launch.strategy = "warp_per_row";
      launch.block_x = 32;
      launch.block_y = kRowsPerBlock;
      launch.grid = static_cast<unsigned>(std::min<int64_t>((outer + kRowsPerBlock - 1) / kRowsPerBlock, kMaxGrid));
    } else {
      launch.strategy = "block_per_row";
      threads = static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(64, pow2_ceil((reduced + 3) / 4))));
      launch.block_x = threads;
      launch.grid = static_cast<unsigned>(std::min<int64_t>(outer, kMaxGrid));
    }
    block_reduce_ = launch.strategy == "block_per_row";
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

 private:
  // 64-bit indices when any element index, or a loop index plus its grid-stride step, could reach 2^31 - 1.
  bool needs_64bit_index(const CudaKernelLaunch& launch) const {
    const int64_t threads = int64_t{launch.grid} * launch.block_x * launch.block_y;
    int64_t largest = nest_.outer_numel() + threads;
    largest = std::max(largest, nest_.reduced_numel() + launch.block_x);
    auto extent = [&](const std::vector<int64_t>& strides, int64_t offset) {
      int64_t e = std::llabs(offset);
      for (size_t l = 0; l < strides.size(); ++l) e += std::llabs(strides[l]) * std::max<int64_t>(nest_.loops[l].size - 1, 0);
      return e;
    };
    for (size_t i = 0; i < k_.exprs.size(); ++i)
      if (k_.exprs[i].kind == ExprKind::Load) largest = std::max(largest, extent(nest_.load_strides[i], k_.exprs[i].index.offset));
    for (size_t s = 0; s < k_.stores.size(); ++s)
      largest = std::max(largest, extent(nest_.store_strides[s], k_.stores[s].index.offset));
    for (size_t i = 0; i < k_.exprs.size(); ++i)
      for (size_t b = 0; b < k_.exprs[i].bounds.size(); ++b)
        largest = std::max(largest, extent(nest_.bound_strides[i][b], k_.exprs[i].bounds[b].index.offset));
    return largest >= kIndex32Limit;
  }

  // A reduction kernel whose accesses walk the innermost output loop contiguously and never the reduced
  // loops, with every store one value per output: the column strategy (see the file comment).
  bool column_shaped() const {
    const int inner = nest_.outer_count - 1;
    if (inner < 0) return false;
    bool contiguous = false;
    for (size_t i = 0; i < k_.exprs.size(); ++i) {
      if (k_.exprs[i].kind != ExprKind::Load) continue;
      const auto& strides = nest_.load_strides[i];
      for (size_t l = nest_.outer_count; l < strides.size(); ++l)
        if (strides[l] == 1) return false;
      if (strides[inner] != 0 && strides[inner] != 1) return false;
      contiguous = contiguous || (strides[inner] == 1 && nest_.runs_reduced(strides));
    }
    for (size_t s = 0; s < k_.stores.size(); ++s)
      if (nest_.runs_reduced(nest_.store_strides[s]) || depends_[k_.stores[s].expr] ||
          nest_.store_strides[s][inner] != 1)
        return false;
    return contiguous;
  }

  // Elements per thread for 16-byte accesses, or 1. Vectors run along the innermost loop: every load
  // walks it with stride 0 or 1 and every store with stride 1. With outer loops too (a bias or a per-channel
  // scale broadcast along rows), the innermost size and every outer stride of a contiguous access must be
  // multiples of the width, so that a vector never straddles two rows and stays aligned.
  int vector_width() const {
    const size_t loops = nest_.loops.size();
    if (loops == 0 || k_.has_bounds_checks()) return 1;  // guarded loads are scalar
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

  std::string index(const std::vector<int64_t>& strides, int64_t offset) const { return index_text(strides, offset); }

  // `const index_t i<first> .. i<last-1>` from the flat index `flat` (the last loop varies fastest).
  void decompose(const std::string& flat, int first, int last, const std::string& indent) {
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

  // The C++ text of expression `e` (operands already named).
  std::string expression(int32_t e) const {
    const Expr& x = k_.exprs[e];
    const std::string ct = compute_type(x.dtype);
    auto name = [&](int i) { return names_[x.operands[i]]; };
    switch (x.kind) {
      case ExprKind::Load: {
        const std::string buffer = "buf" + std::to_string(x.buffer);
        if (lane_ >= 0 && nest_.load_strides[e].back() == 1) return "kiln::load(lv" + std::to_string(e) + ".v[" + std::to_string(lane_) + "])";
        const std::string load = "kiln::load(" + buffer + "[" + index(nest_.load_strides[e], x.index.offset) + "])";
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

  // Emits `e` and its operands not yet named; names made here are forgotten by forget_scope().
  void emit_expr(int32_t e, const std::string& indent) {
    if (!names_[e].empty()) return;
    const Expr& x = k_.exprs[e];
    KILN_ASSERT(x.kind != ExprKind::Reduce) << "kernel " << k_.name << ": reduction " << e << " used before it is computed";
    for (int32_t op : x.operands)
      if (op >= 0) emit_expr(op, indent);
    names_[e] = "v" + std::to_string(e) + (lane_ >= 0 ? "_" + std::to_string(lane_) : "");
    *body_ << indent << "const " << compute_type(x.dtype) << " " << names_[e] << " = " << expression(e) << ";\n";
    scope_.push_back(e);
  }

  void forget_scope() {
    for (int32_t id : scope_) names_[id].clear();
    scope_.clear();
  }

  // Emits the per-row (reduction-independent) expressions `e` needs, stopping at dependent ones; their
  // names stay for the rest of the row.
  void emit_row_values(int32_t e, const std::string& indent) {
    if (!names_[e].empty()) return;
    if (!depends_[e]) {
      emit_expr(e, indent);
      scope_.clear();
      return;
    }
    for (int32_t op : k_.exprs[e].operands)
      if (op >= 0) emit_row_values(op, indent);
  }

  std::string store_text(size_t s, const std::string& value, bool scalar_index) const {
    const auto& st = k_.stores[s];
    const std::string target = "buf" + std::to_string(st.buffer) + "[" +
                               (scalar_index ? index(nest_.store_strides[s], st.index.offset) : "") + "]";
    return target + " = kiln::store_as<" + storage_type(k_.buffers[st.buffer].dtype) + ">::from(" + value + ");";
  }

  // One element of a pointwise kernel at loop indices already in scope.
  void emit_scalar_element(const std::string& indent) {
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      emit_expr(k_.stores[s].expr, indent);
      *body_ << indent << store_text(s, names_[k_.stores[s].expr], true) << "\n";
    }
    forget_scope();
  }

  void emit_pointwise(int64_t n) {
    std::ostream& out = *body_;
    out << "  const index_t n = " << n << ";\n";
    const char* block = device_function_ ? "kiln_block" : "blockIdx.x";
    const char* blocks = device_function_ ? "kiln_blocks" : "gridDim.x";
    out << "  const index_t first = static_cast<index_t>(" << block << ") * blockDim.x + threadIdx.x;\n";
    out << "  const index_t step = static_cast<index_t>(" << blocks << ") * blockDim.x;\n";
    const int outer = nest_.outer_count;
    auto scalar_loop = [&](const std::string& start, const std::string& indent) {
      out << indent << "for (index_t flat = " << start << "; flat < n; flat += step) {\n";
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
    out << "    for (index_t vi = first; vi < vectors; vi += step) {\n";
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

  // Elements per lane and step in the row passes: vectors along the one reduced loop, when every access that
  // runs along it is contiguous there, the row length and every outer stride and offset of those accesses are
  // multiples of the width (so vectors stay inside a row and aligned once the base pointers are).
  int row_vector_width() const {
    if (static_cast<int>(nest_.loops.size()) != nest_.outer_count + 1 || k_.has_bounds_checks()) return 1;
    const size_t red = nest_.loops.size() - 1;
    int width = 8;
    std::vector<std::pair<const std::vector<int64_t>*, int64_t>> contiguous;
    for (size_t i = 0; i < k_.exprs.size(); ++i) {
      const Expr& e = k_.exprs[i];
      if (e.kind != ExprKind::Load || nest_.load_strides[i][red] == 0) continue;
      if (nest_.load_strides[i][red] != 1) return 1;
      width = std::min(width, 16 / type_info(k_.buffers[e.buffer].dtype).bytes);
      contiguous.push_back({&nest_.load_strides[i], e.index.offset});
    }
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      if (nest_.store_strides[s][red] == 0) continue;
      if (nest_.store_strides[s][red] != 1) return 1;
      width = std::min(width, 16 / type_info(k_.buffers[k_.stores[s].buffer].dtype).bytes);
      contiguous.push_back({&nest_.store_strides[s], k_.stores[s].index.offset});
    }
    if (contiguous.empty()) return 1;
    width = std::min<int64_t>(width, 4);  // 4 lanes already give 16-byte float loads; more only adds registers
    for (; width >= 2; width /= 2) {
      bool fits = nest_.loops[red].size % width == 0 && nest_.loops[red].size >= width * 32;
      for (const auto& [strides, offset] : contiguous) {
        fits = fits && offset % width == 0;
        for (size_t l = 0; l < red; ++l) fits = fits && (*strides)[l] % width == 0;
      }
      if (fits) return width;
    }
    return 1;
  }

  bool contiguous_along_reduced(const std::vector<int64_t>& strides) const { return strides.back() == 1 && nest_.runs_reduced(strides); }

  std::string vec_type(int buffer, int width) const {
    return "kiln::vec<" + std::string(storage_type(k_.buffers[buffer].dtype)) + ", " + std::to_string(width) + ">";
  }

  // The run-time test that every access walking the innermost loop contiguously starts on a `width`-element
  // vector boundary (`a && b && ...`). Outer strides are multiples of the width already (vector_width,
  // row_vector_width), so the first element's address decides for all.
  std::string alignment_test(int width) const {
    std::vector<std::string> checks;
    auto check = [&](int buffer, int64_t offset) {
      checks.push_back("kiln::aligned_to(buf" + std::to_string(buffer) + " + " + std::to_string(offset) + ", sizeof(" +
                       vec_type(buffer, width) + "))");
    };
    for (size_t i = 0; i < k_.exprs.size(); ++i)
      if (k_.exprs[i].kind == ExprKind::Load && nest_.load_strides[i].back() == 1) check(k_.exprs[i].buffer, k_.exprs[i].index.offset);
    for (size_t s = 0; s < k_.stores.size(); ++s)
      if (nest_.store_strides[s].back() == 1) check(k_.stores[s].buffer, k_.stores[s].index.offset);
    std::sort(checks.begin(), checks.end());
    checks.erase(std::unique(checks.begin(), checks.end()), checks.end());
    std::string test;
    for (const std::string& c : checks) test += (test.empty() ? "" : " && ") + c;
    return test;
  }

  // Opens a pass over the reduced loops, lanes striding (by row_width_ elements at a time); calls
  // `body(indent)` once per element of the step (lane_ set when vectorised) and stores the vectors of
  // `vector_stores` after it; closes the pass.
  template <typename Body>
  void reduced_pass(const std::string& indent, Body body, const std::vector<size_t>& vector_stores = {}) {
    const int w = row_width_;
    const std::string inner = indent + "  ";
    if (w <= 1) {
      *body_ << indent << "for (index_t red = lane; red < " << nest_.reduced_numel() << "; red += group) {\n";
      decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), inner);
      body(inner);
      forget_scope();
      *body_ << indent << "}\n";
      return;
    }
    *body_ << indent << "for (index_t red = lane * " << w << "; red < " << nest_.reduced_numel() << "; red += group * " << w << ") {\n";
    decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), inner);
    for (size_t i = 0; i < k_.exprs.size(); ++i) {
      const Expr& e = k_.exprs[i];
      if (e.kind != ExprKind::Load || !contiguous_along_reduced(nest_.load_strides[i])) continue;
      *body_ << inner << "const " << vec_type(e.buffer, w) << " lv" << i << " = *reinterpret_cast<const " << vec_type(e.buffer, w)
             << "*>(buf" << e.buffer << " + " << index(nest_.load_strides[i], e.index.offset) << ");\n";
    }
    for (size_t s : vector_stores) *body_ << inner << vec_type(k_.stores[s].buffer, w) << " sv" << s << ";\n";
    for (lane_ = 0; lane_ < w; ++lane_) {
      body(inner);
      forget_scope();
    }
    lane_ = -1;
    for (size_t s : vector_stores)
      *body_ << inner << "*reinterpret_cast<" << vec_type(k_.stores[s].buffer, w) << "*>(buf" << k_.stores[s].buffer << " + "
             << index(nest_.store_strides[s], k_.stores[s].index.offset) << ") = sv" << s << ";\n";
    *body_ << indent << "}\n";
  }

  void emit_rows(int64_t rows) {
    std::ostream& out = *body_;
    // `lane` and `group`: a thread's place among those sharing one output, and their number
    if (thread_row_) {
      out << "  const index_t lane = 0;\n  const index_t group = 1;\n";
    } else {
      out << "  const index_t lane = threadIdx." << (column_ ? "y" : "x") << ";\n";
      out << "  const index_t group = blockDim." << (column_ ? "y" : "x") << ";\n";
    }
    const int width = column_ || thread_row_ ? 1 : row_vector_width();
    if (width <= 1) {
      emit_row_loop(rows, "  ");
      return;
    }
    // Vector passes need the contiguous accesses aligned; otherwise the scalar passes.
    out << "  if (" << alignment_test(width) << ") {\n";
    row_width_ = width;
    emit_row_loop(rows, "    ");
    for (auto& name : names_) name.clear();
    row_width_ = 1;
    out << "  } else {\n";
    emit_row_loop(rows, "    ");
    out << "  }\n";
  }

  void emit_row_loop(int64_t rows, const std::string& base_indent) {
    std::ostream& out = *body_;
    const std::string indent = base_indent + "  ";
    if (column_) {
      // Every thread of the block runs every step (column_reduce has barriers): the threads past the last
      // output redo the last one and store nothing.
      out << base_indent << "for (index_t first_row = static_cast<index_t>(blockIdx.x) * 32; first_row < " << rows
          << "; first_row += static_cast<index_t>(gridDim.x) * 32) {\n";
      out << indent << "const bool active = first_row + threadIdx.x < " << rows << ";\n";
      out << indent << "const index_t row = active ? first_row + threadIdx.x : " << rows - 1 << ";\n";
    } else if (thread_row_) {
      out << base_indent << "for (index_t row = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < " << rows
          << "; row += static_cast<index_t>(gridDim.x) * blockDim.x) {\n";
    } else {
      const unsigned rows_per_block = block_reduce_ ? 1 : kRowsPerBlock;
      out << base_indent << "for (index_t row = static_cast<index_t>(blockIdx.x) * " << rows_per_block
          << " + threadIdx.y; row < " << rows << "; row += static_cast<index_t>(gridDim.x) * " << rows_per_block << ") {\n";
    }
    decompose("row", 0, nest_.outer_count, indent);
    for (size_t r = 0; r < k_.exprs.size(); ++r) {
      const Expr& x = k_.exprs[r];
      if (x.kind != ExprKind::Reduce) continue;
      const int32_t operand = x.operands[0];
      emit_row_values(operand, indent);
      const std::string acc = "acc" + std::to_string(r);
      const std::string init = identity(x.reduce_op, x.dtype);
      out << indent << compute_type(x.dtype) << " " << acc << " = " << init << ";\n";
      reduced_pass(indent, [&](const std::string& inner) {
        emit_expr(operand, inner);
        out << inner << acc << " = " << combiner(x.reduce_op) << "::combine(" << acc << ", "
            << "static_cast<" << compute_type(x.dtype) << ">(" << names_[operand] << "));\n";
      });
      // (thread_per_row: the thread's own serial walk was the whole reduction)
      if (column_) out << indent << acc << " = kiln::column_reduce<" << combiner(x.reduce_op) << ">(" << acc << ", " << init << ");\n";
      else if (block_reduce_) out << indent << acc << " = kiln::block_reduce<" << combiner(x.reduce_op) << ">(" << acc << ", " << init << ");\n";
      else if (!thread_row_) out << indent << acc << " = kiln::warp_reduce<" << combiner(x.reduce_op) << ">(" << acc << ");\n";
      names_[r] = acc;
    }
    std::vector<size_t> along;  // stores that run along the reduced loops
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      const auto& st = k_.stores[s];
      if (depends_[st.expr] || nest_.runs_reduced(nest_.store_strides[s])) {
        along.push_back(s);
        continue;
      }
      emit_row_values(st.expr, indent);
      out << indent << (column_ ? "if (lane == 0 && active) " : "if (lane == 0) ") << store_text(s, names_[st.expr], true) << "\n";
    }
    if (!along.empty()) {
      for (size_t s : along) emit_row_values(k_.stores[s].expr, indent);
      std::vector<size_t> vector_stores;
      if (row_width_ > 1)
        for (size_t s : along)
          if (nest_.store_strides[s].back() == 1) vector_stores.push_back(s);
      reduced_pass(
          indent,
          [&](const std::string& inner) {
            for (size_t s : along) {
              emit_expr(k_.stores[s].expr, inner);
              const bool vector = std::find(vector_stores.begin(), vector_stores.end(), s) != vector_stores.end();
              if (vector)
                out << inner << "sv" << s << ".v[" << lane_ << "] = kiln::store_as<" << storage_type(k_.buffers[k_.stores[s].buffer].dtype)
                    << ">::from(" << names_[k_.stores[s].expr] << ");\n";
              else
                out << inner << store_text(s, names_[k_.stores[s].expr], true) << "\n";
            }
          },
          vector_stores);
    }
    // row-level names belong to this loop's body
    for (size_t r = 0; r < k_.exprs.size(); ++r) names_[r].clear();
    out << base_indent << "}\n";
  }

  const Kernel& k_;
  const graph::Graph& g_;
  fusion::LoopNest nest_;
  const bool device_function_;
  std::vector<bool> depends_;
  std::vector<std::string> names_;
  std::vector<int32_t> scope_;
  std::ostringstream* body_ = nullptr;
  std::string index_type_;
  bool rows_ = false;
  bool block_reduce_ = false;
  bool column_ = false;  // the column strategy (column_shaped)
  bool thread_row_ = false;  // the thread_per_row strategy (small pooling windows)
  int vector_width_ = 1;
  int lane_ = -1;  // the vector lane being emitted, or -1 for scalar code
  int row_width_ = 1;  // elements per lane and step in the row passes being emitted
};

// The launch group's kernel: block ranges, one per member in order, each running its member's code with the
// block index and count it would have had alone. All members are pointwise (kPointwiseBlock threads).
void emit_group(const fusion::Schedule& schedule, const std::vector<int32_t>& group, CudaSource& result,
                std::ostringstream& out) {
  CudaKernelLaunch& launch = result.group;
  launch.name = "kernel_group_inputs";
  launch.strategy = "group";
  launch.block_x = kPointwiseBlock;
  std::string params, body;
  size_t first = 0;
  int64_t blocks = 0;
  for (int32_t i : group) {
    const Kernel& k = schedule.kernels[i];
    params += (params.empty() ? "" : ", ") + parameters(k, "a", first);
    const unsigned grid = result.kernels[i].grid;
    if (grid > 0) {
      body += "  if (block < " + std::to_string(grid) + "u) {\n    " + result.kernels[i].name + "(";
      for (size_t b = 0; b < k.buffers.size(); ++b) body += "a" + std::to_string(first + b) + ", ";
      body += "block, " + std::to_string(grid) + "u);\n    return;\n  }\n  block -= " + std::to_string(grid) + "u;\n";
    }
    blocks += grid;
    first += k.buffers.size();
  }
  launch.grid = static_cast<unsigned>(blocks);
  result.group_members = group;
  out << "\n// launch group: " << group.size() << " pointwise kernels that read only graph inputs, run first\n"
      << "extern \"C\" __global__ void __launch_bounds__(" << kPointwiseBlock << ") " << launch.name << "(" << params
      << ") {\n  unsigned block = blockIdx.x;\n" << body << "}\n";
}

}  // namespace

CudaSource emit_cuda_source(const fusion::Schedule& schedule, const graph::Graph& g, const std::vector<int32_t>& group) {
  CudaSource result;
  result.kernels.resize(schedule.kernels.size());
  std::vector<bool> grouped(schedule.kernels.size(), false);
  for (int32_t i : group) grouped[i] = true;
  // Kernels whose code is the same but for their name (each block of a layer stack makes the same ones) are
  // emitted once and launched under that one name: NVRTC's time grows with the source, and a 6-block
  // transformer has 55 kernels but 9 distinct ones.
  std::unordered_map<std::string, size_t> first_of_body;
  std::vector<std::string> texts(schedule.kernels.size());
  std::vector<int> twin_of(schedule.kernels.size(), -1);
  int distinct_launchable = 0;
  for (size_t i = 0; i < schedule.kernels.size(); ++i) {
    CudaKernelLaunch& launch = result.kernels[i];
    texts[i] = KernelEmitter(schedule.kernels[i], g, grouped[i]).emit(launch);
    const size_t signature = texts[i].find(grouped[i] ? "\n__device__" : "\nextern \"C\"");
    const std::string body = substitute(texts[i].substr(signature), launch.name + "(", "kernel(");
    auto [it, fresh] = first_of_body.emplace(body, i);
    if (!fresh) {
      twin_of[i] = static_cast<int>(it->second);
      launch.name = result.kernels[it->second].name;
    } else if (!grouped[i]) {
      ++distinct_launchable;
    }
  }
  // Parts: one NVRTC program each, compiled side by side (runtime/kernel_graph.cpp). Distinct kernels go round
  // robin; the launch group (its members' device functions and its kernel) stays in part 0; a twin is launched
  // from its original's part.
  const int parts = std::clamp((distinct_launchable + kKernelsPerPart - 1) / kKernelsPerPart, 1, kMaxParts);
  std::vector<std::ostringstream> part_text(parts);
  for (int p = 0; p < parts; ++p) {
    part_text[p] << "// generated by kiln: " << schedule.summary() << (parts > 1 ? ", part " + std::to_string(p + 1) + " of " + std::to_string(parts) : "") << "\n";
    part_text[p] << "#include \"kiln_scalar.cuh\"\n#include \"kiln_reduce.cuh\"\n";
  }
  int next = 0;
  for (size_t i = 0; i < schedule.kernels.size(); ++i) {
    CudaKernelLaunch& launch = result.kernels[i];
    if (twin_of[i] >= 0) {
      launch.part = result.kernels[twin_of[i]].part;
      part_text[launch.part] << "\n" << covers_comment(schedule.kernels[i], g) << "// launched as " << launch.name
                             << " (the same code)\n";
      continue;
    }
    launch.part = grouped[i] ? 0 : next++ % parts;
    part_text[launch.part] << "\n" << texts[i];
  }
  if (!group.empty()) emit_group(schedule, group, result, part_text[0]);
  for (auto& text : part_text) result.parts.push_back(text.str());
  for (const std::string& text : result.parts) result.source += text;
  return result;
}

}  // namespace kiln::codegen::cuda
