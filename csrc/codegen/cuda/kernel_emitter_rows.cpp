// KernelEmitter (kernel_emitter.h): reductions, one row per warp, block or thread, or neighbouring columns per block,
// rendered from the kernel's CudaKernelSchedule.
#include "codegen/cuda/kernel_emitter.h"

#include <algorithm>
#include <cstdlib>

#include "codegen/prim_text.h"
#include "common/error.h"

namespace kiln::codegen::cuda {

void KernelEmitter::emit_column_vector_loop(int64_t rows, const std::string& base_indent) {
  std::ostream& out = *body_;
  const int v = schedule_.column_vector_width;
  const int inner_loop = nest_.outer_count - 1;
  const std::string indent = base_indent + "  ", walk = indent + "  ";
  const int64_t groups = rows / v;
  const int width = schedule_.column_width;
  out << base_indent << "#pragma unroll 1\n" << base_indent << "for (index_t first_row = static_cast<index_t>(blockIdx.x) * "
      << width << "; first_row < " << size(groups) << "; first_row += static_cast<index_t>(gridDim.x) * " << width << ") {\n";
  out << indent << "const bool active = first_row + threadIdx.x < " << size(groups) << ";\n";
  out << indent << "const index_t row = (active ? first_row + threadIdx.x : " << size(groups - 1) << ") * " << v << ";\n";
  decompose("row", 0, nest_.outer_count, indent);
  std::vector<size_t> reductions, early, per_column;
  for (size_t r = 0; r < k_.exprs.size(); ++r)
    if (k_.exprs[r].kind == ExprKind::Reduce) reductions.push_back(r);
  for (size_t s = 0; s < k_.stores.size(); ++s)
    (store_along_reduced(s) ? early : per_column).push_back(s);
  auto acc = [](size_t r, int l) { return "acc" + std::to_string(r) + "_" + std::to_string(l); };
  for (size_t r : reductions)
    for (int l = 0; l < v; ++l)
      out << indent << compute_type(k_.exprs[r].dtype) << " " << acc(r, l) << " = " << identity(k_.exprs[r].reduce_op, k_.exprs[r].dtype)
          << ";\n";
  out << indent << "#pragma unroll 4\n";
  out << indent << "for (index_t red = lane; red < " << size(nest_.reduced_numel()) << "; red += group) {\n";
  decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), walk);
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    const Expr& e = k_.exprs[i];
    if (e.kind != ExprKind::Load || nest_.load_strides[i][inner_loop] != 1) continue;
    out << walk << "const " << vec_type(e.buffer, v) << " lv" << i << " = *reinterpret_cast<const " << vec_type(e.buffer, v)
        << "*>(buf" << e.buffer << " + " << index(nest_.load_strides[i], e.index.offset) << ");\n";
  }
  for (size_t s : early) out << walk << vec_type(k_.stores[s].buffer, v) << " sv" << s << ";\n";
  column_lanes_ = true;
  for (lane_ = 0; lane_ < v; ++lane_) {
    for (size_t r : reductions) {
      const Expr& x = k_.exprs[r];
      emit_expr(x.operands[0], walk);
      out << walk << acc(r, lane_) << " = " << combiner(x.reduce_op) << "::combine(" << acc(r, lane_) << ", static_cast<"
          << compute_type(x.dtype) << ">(" << names_[x.operands[0]] << "));\n";
    }
    for (size_t s : early) {
      emit_expr(k_.stores[s].expr, walk);
      out << walk << "sv" << s << ".v[" << lane_ << "] = kiln::store_as<" << storage_type(k_.buffers[k_.stores[s].buffer].dtype)
          << ">::from(" << names_[k_.stores[s].expr] << ");\n";
    }
    forget_scope();
  }
  lane_ = -1;
  column_lanes_ = false;
  for (size_t s : early)
    out << walk << "if (active) *reinterpret_cast<" << vec_type(k_.stores[s].buffer, v) << "*>(buf" << k_.stores[s].buffer << " + "
        << index(nest_.store_strides[s], k_.stores[s].index.offset) << ") = sv" << s << ";\n";
  out << indent << "}\n";
  for (size_t r : reductions)
    for (int l = 0; l < v; ++l)
      out << indent << acc(r, l) << " = kiln::column_reduce<" << combiner(k_.exprs[r].reduce_op) << ", " << width << ">("
          << acc(r, l) << ");\n";
  for (size_t s : per_column) {
    const fusion::Store& st = k_.stores[s];
    const Expr& x = k_.exprs[st.expr];
    const size_t r = x.kind == ExprKind::Reduce ? static_cast<size_t>(st.expr) : static_cast<size_t>(x.operands[0]);
    for (int l = 0; l < v; ++l)
      out << indent << "if (lane == 0 && active) buf" << st.buffer << "[" << index(nest_.store_strides[s], st.index.offset) << " + "
          << l << "] = kiln::store_as<" << storage_type(k_.buffers[st.buffer].dtype) << ">::from(" << acc(r, l) << ");\n";
  }
  out << base_indent << "}\n";
}

void KernelEmitter::emit_row_values(int32_t e, const std::string& indent) {
  if (!names_[e].empty()) return;
  if (!depends_[e]) {
    emit_expr(e, indent);
    scope_.clear();
    return;
  }
  for (int32_t op : k_.exprs[e].operands)
    if (op >= 0) emit_row_values(op, indent);
}

std::string KernelEmitter::open_cached_steps(const std::string& indent) {
  const std::string inner = indent + "  ";
  *body_ << indent << "#pragma unroll\n" << indent << "for (int chunk = 0; chunk < " << cached_chunks_ << "; ++chunk) {\n";
  *body_ << inner << "const index_t red = (lane + chunk * group) * " << row_width_ << ";\n";
  *body_ << inner << "if (red < " << size(nest_.reduced_numel()) << ") {\n";
  return inner + "  ";
}

template <typename Body>
void KernelEmitter::reduced_pass(const std::string& indent, Body body, const std::vector<size_t>& vector_stores) {
  const int w = row_width_;
  const std::string inner = indent + "  ";
  if (w <= 1) {
    // A column block's threads each walk a whole column with one scalar load per step: unrolled, eight loads are
    // in flight before the first add needs one (the adds keep their order: the same result, bit for bit).
    if (is(CudaKernelKind::Column)) *body_ << indent << "#pragma unroll 8\n";
    *body_ << indent << "for (index_t red = lane; red < " << size(nest_.reduced_numel()) << "; red += group) {\n";
    decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), inner);
    body(inner);
    forget_scope();
    *body_ << indent << "}\n";
    return;
  }
  std::string step = inner;  // the body's indent
  if (cached_chunks_ > 0) {
    step = open_cached_steps(indent);  // unrolled, so that the registers holding the row are indexed by constants
  } else {
    *body_ << indent << "for (index_t red = lane * " << w << "; red < " << size(nest_.reduced_numel()) << "; red += group * " << w << ") {\n";
  }
  decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), step);
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    const Expr& e = k_.exprs[i];
    if (e.kind != ExprKind::Load || !contiguous_along_reduced(nest_.load_strides[i])) continue;
    if (cached_chunks_ > 0)
      *body_ << step << "const " << vec_type(e.buffer, w) << " lv" << i << " = lc" << i << "[chunk];\n";
    else
      *body_ << step << "const " << vec_type(e.buffer, w) << " lv" << i << " = *reinterpret_cast<const " << vec_type(e.buffer, w)
             << "*>(buf" << e.buffer << " + " << index(nest_.load_strides[i], e.index.offset) << ");\n";
  }
  for (size_t s : vector_stores) *body_ << step << vec_type(k_.stores[s].buffer, w) << " sv" << s << ";\n";
  for (lane_ = 0; lane_ < w; ++lane_) {
    body(step);
    forget_scope();
  }
  lane_ = -1;
  for (size_t s : vector_stores)
    *body_ << step << "*reinterpret_cast<" << vec_type(k_.stores[s].buffer, w) << "*>(buf" << k_.stores[s].buffer << " + "
           << index(nest_.store_strides[s], k_.stores[s].index.offset) << ") = sv" << s << ";\n";
  if (cached_chunks_ > 0) *body_ << inner << "}\n";
  *body_ << indent << "}\n";
}

void KernelEmitter::emit_row_cache(const std::string& indent) {
  const int w = row_width_;
  std::vector<size_t> loads;
  for (size_t i = 0; i < k_.exprs.size(); ++i)
    if (k_.exprs[i].kind == ExprKind::Load && contiguous_along_reduced(nest_.load_strides[i])) loads.push_back(i);
  for (size_t i : loads) *body_ << indent << vec_type(k_.exprs[i].buffer, w) << " lc" << i << "[" << cached_chunks_ << "];\n";
  const std::string step = open_cached_steps(indent);
  decompose("red", nest_.outer_count, static_cast<int>(nest_.loops.size()), step);
  for (size_t i : loads) {
    const Expr& e = k_.exprs[i];
    *body_ << step << "lc" << i << "[chunk] = *reinterpret_cast<const " << vec_type(e.buffer, w) << "*>(buf" << e.buffer << " + "
           << index(nest_.load_strides[i], e.index.offset) << ");\n";
  }
  *body_ << indent << "  }\n" << indent << "}\n";
}

void KernelEmitter::emit_rows(int64_t rows) {
  std::ostream& out = *body_;
  // `lane` and `group`: a thread's place among those sharing one output, and their number
  const bool column = is(CudaKernelKind::Column);
  if (is(CudaKernelKind::ThreadPerRow)) {
    out << "  const index_t lane = 0;\n  const index_t group = 1;\n";
  } else {
    out << "  const index_t lane = threadIdx." << (column ? "y" : "x") << ";\n";
    out << "  const index_t group = blockDim." << (column ? "y" : "x") << ";\n";
  }
  if (column && schedule_.column_vector_width > 1) {
    // Vector accesses need every access along the columns aligned; otherwise the scalar columns.
    out << "  if (" << alignment_test(schedule_.column_vector_width, nest_.outer_count - 1) << ") {\n";
    emit_column_vector_loop(rows, "    ");
    for (auto& name : names_) name.clear();
    out << "  } else {\n";
    emit_row_loop(rows, "    ");
    out << "  }\n";
    return;
  }
  const int width = schedule_.row_vector_width;  // 1 but for warp and block per row
  if (width <= 1) {
    emit_row_loop(rows, "  ");
    return;
  }
  // Vector passes need the contiguous accesses aligned; otherwise the scalar passes (never cached).
  out << "  if (" << alignment_test(width) << ") {\n";
  row_width_ = width;
  emit_row_loop(rows, "    ");
  for (auto& name : names_) name.clear();
  row_width_ = 1;
  cached_chunks_ = 0;
  out << "  } else {\n";
  emit_row_loop(rows, "    ");
  out << "  }\n";
  cached_chunks_ = schedule_.cached_row_chunks;
}

void KernelEmitter::emit_row_loop(int64_t rows, const std::string& base_indent) {
  std::ostream& out = *body_;
  const std::string indent = base_indent + "  ";
  const bool column = is(CudaKernelKind::Column);
  if (column) {
    // Every thread of the block runs every step (column_reduce has barriers): the threads past the last
    // output redo the last one and store nothing.
    out << base_indent << "#pragma unroll 1\n" << base_indent << "for (index_t first_row = static_cast<index_t>(blockIdx.x) * "
        << schedule_.column_width << "; first_row < " << size(rows) << "; first_row += static_cast<index_t>(gridDim.x) * "
        << schedule_.column_width << ") {\n";
    out << indent << "const bool active = first_row + threadIdx.x < " << size(rows) << ";\n";
    out << indent << "const index_t row = active ? first_row + threadIdx.x : " << size(rows - 1) << ";\n";
  } else if (is(CudaKernelKind::ThreadPerRow)) {
    out << base_indent << "#pragma unroll 1\n" << base_indent
        << "for (index_t row = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < " << size(rows)
        << "; row += static_cast<index_t>(gridDim.x) * blockDim.x) {\n";
  } else {
    const unsigned rows_per_block = schedule_.rows_per_block;
    out << base_indent << "#pragma unroll 1\n" << base_indent << "for (index_t row = static_cast<index_t>(blockIdx.x) * "
        << rows_per_block
        << " + threadIdx.y; row < " << size(rows) << "; row += static_cast<index_t>(gridDim.x) * " << rows_per_block << ") {\n";
  }
  decompose("row", 0, nest_.outer_count, indent);
  if (cached_chunks_ > 0) emit_row_cache(indent);
  // The column strategy's stores along the reduced loops (a fused producer's result, which the reduction sums
  // too) are made in the first reduction's walk: its loads are not repeated in a second one.
  std::vector<size_t> early;
  if (column)
    for (size_t s = 0; s < k_.stores.size(); ++s)
      if (store_along_reduced(s) && !uses_reductions_[k_.stores[s].expr]) early.push_back(s);
  // Walks over the reduced loops: the first computes every reduction whose operand uses no other reduction (a
  // layer norm gradient's two row sums, a weight and a bias gradient's column sums: each element loaded once),
  // each later one a reduction that needs an earlier one's result (softmax's sum after its max).
  std::vector<std::vector<size_t>> walks(1);
  for (size_t r = 0; r < k_.exprs.size(); ++r) {
    if (k_.exprs[r].kind != ExprKind::Reduce) continue;
    if (uses_reductions_[k_.exprs[r].operands[0]]) walks.push_back({r});
    else walks[0].push_back(r);
  }
  for (size_t w = 0; w < walks.size(); ++w) {
    const std::vector<size_t>& reductions = walks[w];
    if (reductions.empty()) continue;
    const std::vector<size_t> with = w == 0 ? early : std::vector<size_t>{};
    for (size_t r : reductions) emit_row_values(k_.exprs[r].operands[0], indent);
    for (size_t s : with) emit_row_values(k_.stores[s].expr, indent);
    for (size_t r : reductions)
      out << indent << compute_type(k_.exprs[r].dtype) << " acc" << r << " = " << identity(k_.exprs[r].reduce_op, k_.exprs[r].dtype)
          << ";\n";
    reduced_pass(indent, [&](const std::string& inner) {
      for (size_t r : reductions) {
        const Expr& x = k_.exprs[r];
        emit_expr(x.operands[0], inner);
        out << inner << "acc" << r << " = " << combiner(x.reduce_op) << "::combine(acc" << r << ", "
            << "static_cast<" << compute_type(x.dtype) << ">(" << names_[x.operands[0]] << "));\n";
      }
      for (size_t s : with) {
        emit_expr(k_.stores[s].expr, inner);
        out << inner << "if (active) " << store_text(s, names_[k_.stores[s].expr], true) << "\n";
      }
    });
    for (size_t r : reductions) {
      const Expr& x = k_.exprs[r];
      const std::string acc = "acc" + std::to_string(r);
      // The threads sharing the row combine their accumulators, each kind its own way (thread_per_row: the
      // thread's own serial walk was the whole reduction).
      switch (schedule_.kind) {
        case CudaKernelKind::Column:
          out << indent << acc << " = kiln::column_reduce<" << combiner(x.reduce_op) << ", " << schedule_.column_width << ">("
              << acc << ");\n";
          break;
        case CudaKernelKind::BlockPerRow:
          out << indent << acc << " = kiln::block_reduce<" << combiner(x.reduce_op) << ">(" << acc << ", "
              << identity(x.reduce_op, x.dtype) << ");\n";
          break;
        case CudaKernelKind::WarpPerRow:
          out << indent << acc << " = kiln::warp_reduce<" << combiner(x.reduce_op) << ">(" << acc << ");\n";
          break;
        case CudaKernelKind::ThreadPerRow:
        case CudaKernelKind::Pointwise:
          break;
      }
      names_[r] = acc;
    }
  }
  std::vector<size_t> along;  // stores that run along the reduced loops
  for (size_t s = 0; s < k_.stores.size(); ++s) {
    const auto& st = k_.stores[s];
    if (store_along_reduced(s)) {
      if (std::find(early.begin(), early.end(), s) == early.end()) along.push_back(s);
      continue;
    }
    emit_row_values(st.expr, indent);
    out << indent << (column ? "if (lane == 0 && active) " : "if (lane == 0) ") << store_text(s, names_[st.expr], true) << "\n";
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

}  // namespace kiln::codegen::cuda
