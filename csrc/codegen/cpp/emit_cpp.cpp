// C++/OpenMP code generation from the loop IR.
//
// Design: the kernel's domain is first turned into loops (fusion/loop_nest.h), so a contiguous pointwise
// kernel is one flat loop, `#pragma omp parallel for simd`. Per outer index the body computes each reduction in its own
// loop over the reduced dims (recomputing the pointwise prologue it needs: loads are cheap next to a
// second pass over memory), then the per-outer values and stores, then one more loop over the reduced dims
// for stores that run along them (softmax's output, layer norm's y). Expressions that do not depend on a
// reduced loop variable are emitted once, before the loop that needs them. Padded and windowed reads are
// guarded loads, `in_bounds ? buf[i] : fill`, which never touch memory outside the buffer.
#include "codegen/cpp/emit_cpp.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <limits>
#include <sstream>
#include <unordered_map>

#include "codegen/prim_text.h"
#include "codegen/size_arguments.h"
#include "common/error.h"
#include "device_lib/cpp_prelude.h"
#include "fusion/loop_nest.h"

namespace kiln::codegen::cpp {

using decomp::PrimOp;
using fusion::Expr;
using fusion::ExprKind;
using fusion::Kernel;
using graph::ScalarType;

namespace {

constexpr int64_t kParallelThreshold = 32768;  // elements below which threads cost more than they save
constexpr int64_t kTile = 16;
constexpr int64_t kMaxColumnBlock = 512;  // columns per block of a column reduction, at most  // side of the tiles of a transposing kernel: 64 bytes of float32 per row

const char* storage_type(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: return "bool";
    case ScalarType::Byte: return "uint8_t";
    case ScalarType::Char: return "int8_t";
    case ScalarType::Short: return "int16_t";
    case ScalarType::Int: return "int32_t";
    case ScalarType::Long: return "int64_t";
    case ScalarType::Half: return "kiln_half";
    case ScalarType::BFloat16: return "kiln_bf16";
    case ScalarType::Float: return "float";
    case ScalarType::Double: return "double";
    default: KILN_ASSERT(false) << "no C++ type for dtype " << graph::scalar_type_name(t); return "";
  }
}

const char* compute_type(ScalarType t) {
  return (t == ScalarType::Half || t == ScalarType::BFloat16) ? "float" : storage_type(t);
}

// A row sum computed in float is taken in blocks of kSumBlock elements along the innermost reduced loop: each block
// in a float (vectorised, a few SIMD lanes), the blocks added in double. Added in one float, a sum over n elements
// loses about n/8 float ulps, where ATen's cascade sum keeps log(n): over 2^20 floats kiln's error was 35x eager's,
// and is now eager's. A double accumulator throughout did as well but made the sums 1.5-3x slower.
constexpr int64_t kSumBlock = 1024;
constexpr int64_t kColumnSumRows = 256;  // rows per block of a column sum
const char* accumulator_type(const Expr& x) {
  const char* ct = compute_type(x.dtype);
  return x.reduce_op == decomp::ReduceOp::Sum && std::string(ct) == "float" ? "double" : ct;
}

std::string literal(double v, ScalarType t) {
  std::ostringstream out;
  const std::string ct = compute_type(t);
  if (t == ScalarType::Bool) return v != 0 ? "true" : "false";
  if (!graph::is_floating_or_complex(t)) {
    // -2^63 has no literal (9223372036854775808 overflows before the minus applies)
    if (v <= static_cast<double>(std::numeric_limits<int64_t>::lowest())) return "static_cast<" + ct + ">(INT64_MIN)";
    out << "static_cast<" << ct << ">(INT64_C(" << static_cast<int64_t>(v) << "))";
    return out.str();
  }
  if (std::isnan(v)) return "std::numeric_limits<" + ct + ">::quiet_NaN()";
  if (std::isinf(v)) return std::string(v < 0 ? "-" : "") + "std::numeric_limits<" + ct + ">::infinity()";
  out << "static_cast<" << ct << ">(" << std::setprecision(17) << v << ")";
  return out.str();
}

class KernelEmitter {
 public:
  KernelEmitter(const Kernel& k, const graph::Graph& g, bool size_arguments)
      : k_(k), g_(g), nest_(fusion::build_loop_nest(k)), depends_(fusion::depends_on_reduced_loops(k, nest_)),
        sizes_(size_arguments) {
    names_.resize(k.exprs.size());
  }

  /// The kernel's function; with size arguments, `sizes` gets the values of its slots.
  std::string emit(std::vector<int64_t>& sizes) {
    std::string text = emit_function();
    if (sizes_.enabled()) {
      text.insert(slots_at_, slot_declarations());
      sizes = sizes_.values();
    }
    return text;
  }

 private:
  std::string emit_function() {
    std::ostringstream out;
    out << "// " << k_.name << " covers graph nodes:";
    for (graph::NodeIndex n : k_.nodes) out << " " << n << ":" << g_.nodes[n].qualified_name();
    out << "\nextern \"C\" void " << k_.name << "(void* const* buffers" << (sizes_.enabled() ? ", const int64_t* sizes" : "")
        << ") {\n";
    for (size_t b = 0; b < k_.buffers.size(); ++b) {
      const auto& buf = k_.buffers[b];
      const char* type = storage_type(buf.dtype);
      out << "  " << (buf.is_output ? "" : "const ") << type << "* __restrict__ buf" << b << " = static_cast<"
          << (buf.is_output ? "" : "const ") << type << "*>(buffers[" << b << "]);  // %" << buf.value << "\n";
    }
    slots_at_ = static_cast<size_t>(out.tellp());
    int64_t numel = 1;
    for (int64_t s : k_.domain) numel *= s;
    if (nest_.outer_numel() == 0) {  // an empty reduction still stores its initial values (sum of nothing = 0)
      out << "  (void)buffers;" << (sizes_.enabled() ? " (void)sizes;" : "") << "  // empty domain\n}\n";
      return out.str();
    }
    // With size arguments the threshold is tested at run time (OpenMP's if clause), so that the parallel and the
    // serial bindings share one source.
    const bool parallel = sizes_.enabled() || numel >= kParallelThreshold;
    if (sizes_.enabled()) parallel_if_ = " if(parallel: " + sizes_(numel) + " >= " + std::to_string(kParallelThreshold) + ")";
    if (column_reduction_applies()) {
      emit_column_reduction(out, parallel);
      out << "}\n";
      return out.str();
    }
    const int outer = nest_.outer_count;
    const bool reduces = static_cast<int>(nest_.loops.size()) > outer;
    if (const int across = transposing_loop(); !reduces && across >= 0) {
      emit_tiled(out, across, parallel);
      return out.str();
    }
    std::string indent = "  ";
    for (int l = 0; l < outer; ++l) {
      if (l == 0 && parallel) {
        if (!reduces && outer == 1) out << indent << "#pragma omp parallel for simd" << parallel_if_ << "\n";
        else if (!reduces) out << indent << "#pragma omp parallel for" << (outer > 2 ? " collapse(" + std::to_string(outer - 1) + ")" : "") << parallel_if_ << "\n";
        else out << indent << "#pragma omp parallel for" << (outer > 1 ? " collapse(" + std::to_string(outer) + ")" : "") << parallel_if_ << "\n";
      } else if (!reduces && l == outer - 1 && !(l == 0 && parallel)) {
        out << indent << "#pragma omp simd\n";
      }
      out << indent << "for (int64_t i" << l << " = 0; i" << l << " < " << loop_size(l) << "; ++i" << l << ") {\n";
      indent += "  ";
    }
    body_ = &out;
    indent_ = indent;
    emit_body();
    for (int l = outer - 1; l >= 0; --l) {
      indent.resize(indent.size() - 2);
      out << indent << "}\n";
    }
    out << "}\n";
    return out.str();
  }

  // `const int64_t sz0 = sizes[0], ...;`: the size slots, read once at the function's start.
  std::string slot_declarations() const {
    std::string text;
    const std::vector<int64_t>& values = sizes_.values();
    for (size_t k = 0; k < values.size(); ++k) {
      const std::string slot = sizes_.prefix() + std::to_string(k);
      text += (k % 8 == 0 ? "  const int64_t " : ", ") + slot + " = sizes[" + std::to_string(k) + "]";
      if (k % 8 == 7 || k + 1 == values.size()) text += ";\n";
    }
    return text;
  }

  // A loop's trip count.
  std::string loop_size(int l) const { return sizes_(nest_.loops[l].size); }

  bool strides_run_reduced(const std::vector<int64_t>& strides) const { return nest_.runs_reduced(strides); }

  // A pointwise kernel that transposes: the innermost loop (contiguous in the first output) reads some input
  // with a large stride, and that input is contiguous along another loop (a channels-last value written back
  // in the default layout, as after a channels-last convolution). Walking the output row by row would then
  // read one element per cache line of that input, each line once per output row (conv + ReLU on CPU: 20 ms
  // against 0.6 ms for the convolution). Returns that other loop, or -1.
  int transposing_loop() const {
    const int outer = nest_.outer_count;
    if (k_.scalar_loads_only()) return -1;
    if (outer < 2 || static_cast<int>(nest_.loops.size()) != outer) return -1;
    const int inner = outer - 1;
    if (nest_.loops[inner].size < kTile) return -1;
    for (size_t e = 0; e < k_.exprs.size(); ++e) {
      if (k_.exprs[e].kind != ExprKind::Load || !k_.exprs[e].bounds.empty()) continue;
      const std::vector<int64_t>& strides = nest_.load_strides[e];
      if (std::llabs(strides[inner]) <= 1) continue;
      for (int l = 0; l < inner; ++l)
        if (std::llabs(strides[l]) == 1 && nest_.loops[l].size >= kTile) return l;
    }
    return -1;
  }

  // The loops of a transposing pointwise kernel in kTile x kTile tiles of (loop `across`, innermost loop): a
  // tile reads kTile lines of the transposed input and writes kTile lines of the output, each line whole. The
  // other loops and the two tile loops run in parallel (collapsed); the tiles along the innermost loop are the
  // outer tile loop, so each thread reads a run of whole lines of the transposed input (the other order had the
  // threads read alternate halves of each line: 0.32 against 0.23 ms for conv + ReLU's 6 MB on 2 cores).
  // When every store is float32 and contiguous along the innermost loop, a whole tile is computed in the order
  // the transposed input is contiguous in (vectorised along `across`) into a local tile per store, which the
  // prelude's kiln_store_transposed16x16 writes out with 8 x 8 register transposes: 0.23 against 0.72 ms for
  // that ReLU (a plain copy of the same bytes: 0.23). Partial tiles at the edges take the element-wise form.
  void emit_tiled(std::ostringstream& out, int across, bool parallel) {
    const int outer = nest_.outer_count;
    const int inner = outer - 1;
    std::string indent = "  ";
    std::vector<int> plain;
    for (int l = 0; l < inner; ++l)
      if (l != across) plain.push_back(l);
    if (parallel) out << indent << "#pragma omp parallel for collapse(" << plain.size() + 2 << ")" << parallel_if_ << "\n";
    for (int l : plain) {
      out << indent << "for (int64_t i" << l << " = 0; i" << l << " < " << loop_size(l) << "; ++i" << l << ") {\n";
      indent += "  ";
    }
    for (int l : {inner, across}) {
      out << indent << "for (int64_t t" << l << " = 0; t" << l << " < " << loop_size(l) << "; t" << l
          << " += " << kTile << ") {\n";
      indent += "  ";
    }
    const std::string a = std::to_string(across), i = std::to_string(inner);
    const bool register_transpose = stores_transpose_in_registers(across, inner);
    if (register_transpose) {
      out << indent << "if (t" << a << " + " << kTile << " <= " << loop_size(across) << " && t" << i << " + "
          << kTile << " <= " << loop_size(inner) << ") {\n";
      const std::string body_indent = indent + "      ";
      for (size_t s = 0; s < k_.stores.size(); ++s)
        out << indent << "  alignas(64) float tile" << s << "[" << kTile * kTile << "];\n";
      out << indent << "  for (int64_t i" << i << " = t" << i << "; i" << i << " < t" << i << " + " << kTile << "; ++i" << i
          << ") {\n";
      out << indent << "    #pragma omp simd\n";
      out << indent << "    for (int64_t i" << a << " = t" << a << "; i" << a << " < t" << a << " + " << kTile << "; ++i"
          << a << ") {\n";
      tile_slot_ = "[(i" + i + " - t" + i + ") * " + std::to_string(kTile) + " + (i" + a + " - t" + a + ")]";
      body_ = &out;
      indent_ = body_indent;
      const std::vector<std::string> unnamed = names_;
      emit_body();
      names_ = unnamed;  // the edge tiles below emit the body again, in their own scope
      tile_slot_.clear();
      out << indent << "    }\n" << indent << "  }\n";
      out << indent << "  const int64_t i" << a << " = t" << a << ", i" << i << " = t" << i << ";\n";
      for (size_t s = 0; s < k_.stores.size(); ++s) {
        const auto& st = k_.stores[s];
        out << indent << "  kiln_store_transposed16x16(tile" << s << ", &buf" << st.buffer << "["
            << index(nest_.store_strides[s], st.index.offset) << "], "
            << sizes_.stride(nest_.store_strides[s][across], "INT64_C(" + std::to_string(nest_.store_strides[s][across]) + ")")
            << ");\n";
      }
      out << indent << "} else {\n";
      indent += "  ";
    }
    for (int l : {across, inner}) {
      if (l == inner) out << indent << "#pragma omp simd\n";
      out << indent << "for (int64_t i" << l << " = t" << l << "; i" << l << " < std::min<int64_t>(t" << l << " + "
          << kTile << ", " << loop_size(l) << "); ++i" << l << ") {\n";
      indent += "  ";
    }
    body_ = &out;
    indent_ = indent;
    emit_body();
    const size_t closing = plain.size() + 4 + (register_transpose ? 1 : 0);
    for (size_t l = 0; l < closing; ++l) {
      indent.resize(indent.size() - 2);
      out << indent << "}\n";
    }
    out << "}\n";
  }

  // True when every store of the tiled kernel writes float32, contiguously along the innermost loop and with a
  // stride of at least a tile along `across` (kiln_store_transposed16x16's layout).
  bool stores_transpose_in_registers(int across, int inner) const {
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      const std::vector<int64_t>& strides = nest_.store_strides[s];
      if (k_.buffers[k_.stores[s].buffer].dtype != ScalarType::Float || strides[inner] != 1 ||
          std::llabs(strides[across]) < kTile)
        return false;
    }
    return !k_.stores.empty();
  }

  std::string index(const std::vector<int64_t>& strides, int64_t offset) const {
    std::ostringstream out;
    out << sizes_.stride(offset, std::to_string(offset));
    for (size_t l = 0; l < strides.size(); ++l)
      if (strides[l] != 0)
        out << " + " << sizes_.stride(strides[l], "INT64_C(" + std::to_string(strides[l]) + ")") << " * i" << l;
    return out.str();
  }

  // The C++ text of expression `e` (operands already named).
  std::string expression(int32_t e) const {
    const Expr& x = k_.exprs[e];
    const std::string ct = compute_type(x.dtype);
    auto name = [&](int i) { return names_[x.operands[i]]; };
    switch (x.kind) {
      case ExprKind::Load: {
        std::string address = index(nest_.load_strides[e], x.index.offset);
        if (x.operands[1] >= 0)  // gathered: the index value, checked (kiln_gather_index), times its stride
          address += " + kiln_gather_index(" + name(1) + ", " + sizes_(x.gather_extent, std::to_string(x.gather_extent) + "ll") +
                     ") * " + sizes_.stride(x.gather_stride, std::to_string(x.gather_stride));
        const std::string load = "kiln_load(buf" + std::to_string(x.buffer) + "[" + address + "])";
        if (x.operands[0] < 0) return load;
        return "(" + name(0) + " ? " + load + " : " + literal(x.constant, x.dtype) + ")";
      }
      case ExprKind::Iota:
        return "static_cast<int64_t>(" + index(nest_.load_strides[e], x.index.offset) + ")";
      case ExprKind::InBounds: {
        std::string test;
        for (size_t b = 0; b < x.bounds.size(); ++b) {
          std::string i = "(";  // appended, not `"(" + ...`: GCC 12 warns falsely (-Wrestrict) on that form
          i += index(nest_.bound_strides[e][b], x.bounds[b].index.offset);
          i += ")";
          test += (b ? " && " : "") + i + " >= 0 && " + i + " < " + sizes_(x.bounds[b].extent);
        }
        return "(" + test + ")";
      }
      case ExprKind::Constant: {
        const std::string slot = sizes_.constant(k_, e, ct);
        return slot.empty() ? literal(x.constant, x.dtype) : slot;
      }
      case ExprKind::Cast: {
        const ScalarType from = k_.exprs[x.operands[0]].dtype;
        if (x.dtype == ScalarType::Bool) return "(" + name(0) + " != 0)";
        std::string converted = "static_cast<" + ct + ">(" + name(0) + ")";
        const bool narrows = from == ScalarType::Float || from == ScalarType::Double || !graph::is_floating_or_complex(from);
        if (x.dtype == ScalarType::BFloat16 && narrows) return "kiln_round_bf16(" + converted + ")";
        if (x.dtype == ScalarType::Half && narrows) return "kiln_round_half(" + converted + ")";
        return converted;
      }
      case ExprKind::Unary:
      case ExprKind::Binary:
      case ExprKind::Where: {
        return fill_prim_format(decomp::prim_facts(x.kind == ExprKind::Where ? PrimOp::Where : x.op).cpp, x,
                                compute_type(k_.exprs[typed_operand(x)].dtype), names_);
      }
      case ExprKind::Reduce:
        break;
    }
    KILN_ASSERT(false) << "kernel " << k_.name << ": expression " << e << " cannot be emitted inline";
    return "";
  }

  // Emits `e` and its operands that are not yet named into `out`; `inner` allows dependent expressions.
  void emit_expr(int32_t e, std::ostream& out, const std::string& indent, std::vector<std::string>& scope) {
    if (!names_[e].empty()) return;
    const Expr& x = k_.exprs[e];
    KILN_ASSERT(x.kind != ExprKind::Reduce) << "kernel " << k_.name << ": reduction " << e << " used before it is computed";
    for (int32_t op : x.operands)
      if (op >= 0) emit_expr(op, out, indent, scope);
    names_[e] = "v";  // appended, not `"v" + ...`: GCC 12 warns falsely (-Wrestrict) on that form once inlined
    names_[e] += std::to_string(e);
    out << indent << "const " << compute_type(x.dtype) << " " << names_[e] << " = " << expression(e) << ";\n";
    scope.push_back(names_[e]);
    scope_ids_.push_back(e);
  }

  // Emits the outer-level (reduced-independent) expressions `e` needs, stopping at dependent ones.
  void emit_outer_deps(int32_t e) {
    if (!names_[e].empty()) return;
    if (!depends_[e]) {
      std::vector<std::string> scope;
      emit_expr(e, *body_, indent_, scope);
      scope_ids_.clear();  // outer names stay for the rest of this outer iteration
      return;
    }
    for (int32_t op : k_.exprs[e].operands)
      if (op >= 0) emit_outer_deps(op);
  }

  // Opens the reduced loops; calls `body(indent)`; closes them and forgets the names made inside.
  // A float sum's blocks (kSumBlock): `part` (of `type`, from `init`) sums one block of the innermost reduced loop,
  // then is added to `total`.
  struct SumBlocks {
    std::string part, type, init, total;
  };

  // Opens the walk over loop `l` in blocks of `block` iterations (`i<l>b`, each block's end `i<l>e`); the caller
  // opens the loop over one block (`block_loop`) and closes both.
  void open_blocks(std::ostream& out, std::string& indent, int l, int64_t block) {
    const std::string i = "i" + std::to_string(l);
    out << indent << "for (int64_t " << i << "b = 0; " << i << "b < " << loop_size(l) << "; " << i << "b += " << block << ") {\n";
    indent += "  ";
    out << indent << "const int64_t " << i << "e = " << i << "b + " << block << " < " << loop_size(l) << " ? " << i << "b + "
        << block << " : " << loop_size(l) << ";\n";
  }
  static std::string block_loop(int l) {
    std::ostringstream out;
    out << "for (int64_t i" << l << " = i" << l << "b; i" << l << " < i" << l << "e; ++i" << l << ") {\n";
    return out.str();
  }

  void reduced_loops(const std::function<void(const std::string&)>& body, const std::string& simd_clause,
                     const SumBlocks* blocks = nullptr) {
    std::string indent = indent_;
    const int outer = nest_.outer_count;
    const int total = static_cast<int>(nest_.loops.size());
    for (int l = outer; l < total; ++l) {
      const std::string i = "i" + std::to_string(l);
      if (l == total - 1 && blocks) {
        open_blocks(*body_, indent, l, kSumBlock);
        *body_ << indent << blocks->type << " " << blocks->part << " = " << blocks->init << ";\n";
        *body_ << indent << "#pragma omp simd" << simd_clause << "\n" << indent << block_loop(l);
        indent += "  ";
        continue;
      }
      if (l == total - 1 && !simd_clause.empty()) *body_ << indent << "#pragma omp simd" << simd_clause << "\n";
      *body_ << indent << "for (int64_t " << i << " = 0; " << i << " < " << loop_size(l) << "; ++" << i << ") {\n";
      indent += "  ";
    }
    scope_ids_.clear();
    body(indent);
    for (int32_t id : scope_ids_) names_[id].clear();
    scope_ids_.clear();
    for (int l = total - 1; l >= outer; --l) {
      indent.resize(indent.size() - 2);
      *body_ << indent << "}\n";
      if (l == total - 1 && blocks) {
        *body_ << indent << blocks->total << " += " << blocks->part << ";\n";
        indent.resize(indent.size() - 2);
        *body_ << indent << "}\n";
      }
    }
  }

  // True when expression `e` appears in the tree of expression `root` (without crossing reductions).
  bool uses(int32_t root, int32_t e) const {
    if (root == e) return true;
    const Expr& x = k_.exprs[root];
    if (x.kind == ExprKind::Reduce) return false;
    for (int32_t op : x.operands)
      if (op >= 0 && uses(op, e)) return true;
    return false;
  }

  // Softmax-like kernels: the last reduction's operand (exp(x - max)) is also what the single store
  // along the reduced dims needs. Instead of computing it twice, the reduction loop writes it into the
  // output and the store loop reads it back (as ATen's kernel does). Only when the output holds exactly
  // the operand's type and nothing in the kernel reads that buffer. Returns the store index, or -1.
  int stash_store_for(int32_t reduction) const {
    int32_t operand = k_.exprs[reduction].operands[0];
    if (!depends_[operand]) return -1;
    for (size_t r = reduction + 1; r < k_.exprs.size(); ++r)
      if (k_.exprs[r].kind == ExprKind::Reduce) return -1;
    int found = -1;
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      const auto& st = k_.stores[s];
      if (!(depends_[st.expr] || strides_run_reduced(nest_.store_strides[s]))) continue;
      if (found >= 0) return -1;  // several stores along the reduced dims: keep it simple
      found = static_cast<int>(s);
    }
    if (found < 0) return -1;
    const auto& st = k_.stores[found];
    const auto& buf = k_.buffers[st.buffer];
    if (!uses(st.expr, operand) || buf.dtype != k_.exprs[operand].dtype ||
        std::string(storage_type(buf.dtype)) != compute_type(buf.dtype))
      return -1;
    for (const Expr& x : k_.exprs)
      if (x.kind == ExprKind::Load && x.buffer == st.buffer) return -1;
    return found;
  }

  void emit_body() {
    int stash = -1;           // store that receives the last reduction's operand (see stash_store_for)
    int32_t stashed = -1;     // that operand
    for (size_t r = 0; r < k_.exprs.size(); ++r) {
      const Expr& x = k_.exprs[r];
      if (x.kind != ExprKind::Reduce) continue;
      const int32_t operand = x.operands[0];
      emit_outer_deps(operand);
      const std::string acc = "acc" + std::to_string(r);
      const std::string ct = compute_type(x.dtype);
      const std::string at = accumulator_type(x);
      const std::string init = reduction_identity(x);
      // A float sum adds into `part` per block (SumBlocks), the blocks into the double `acc`.
      const bool blocked = at != ct && nest_.outer_count < static_cast<int>(nest_.loops.size());
      const std::string part = acc + "_part";
      const SumBlocks blocks{part, ct, init, acc};
      std::string clause;
      if (x.reduce_op == decomp::ReduceOp::Sum) clause = " reduction(+:" + (blocked ? part : acc) + ")";
      // Max/min propagate NaN like torch.amax. Written as a plain max/min reduction plus a separate "saw a
      // NaN" flag, both of which OpenMP can vectorise; the NaN is applied after the loop.
      const bool minmax = x.reduce_op != decomp::ReduceOp::Sum;
      const bool floating = graph::is_floating_or_complex(x.dtype);
      const std::string nan = acc + "_nan";
      if (minmax) clause = std::string(" reduction(") + (x.reduce_op == decomp::ReduceOp::Max ? "max" : "min") + ":" + acc + ")";
      if (minmax && floating) clause += " reduction(|:" + nan + ")";
      if (!minmax && (stash = stash_store_for(static_cast<int32_t>(r))) >= 0) stashed = operand;
      *body_ << indent_ << at << " " << acc << " = " << init << ";\n";
      if (minmax && floating) *body_ << indent_ << "int " << nan << " = 0;\n";
      reduced_loops(
          [&](const std::string& indent) {
            std::vector<std::string> scope;
            emit_expr(operand, *body_, indent, scope);
            const std::string v = names_[operand];
            if (!minmax) {
              *body_ << indent << (blocked ? part : acc) << " += " << v << ";\n";
              if (stash >= 0) {
                const auto& st = k_.stores[stash];
                *body_ << indent << "buf" << st.buffer << "[" << index(nest_.store_strides[stash], st.index.offset)
                       << "] = " << v << ";  // kept for the store loop below\n";
              }
              return;
            }
            if (floating) *body_ << indent << nan << " |= (" << v << " != " << v << ");\n";
            const char* cmp = x.reduce_op == decomp::ReduceOp::Max ? " > " : " < ";
            *body_ << indent << acc << " = (" << v << cmp << acc << ") ? " << v << " : " << acc << ";\n";
          },
          clause, blocked ? &blocks : nullptr);
      if (minmax && floating)
        *body_ << indent_ << acc << " = " << nan << " ? std::numeric_limits<" << ct << ">::quiet_NaN() : " << acc << ";\n";
      names_[r] = acc;
      if (at != ct) {  // read as the compute type from here on, as without the wider accumulator
        *body_ << indent_ << "const " << ct << " " << acc << "_sum = static_cast<" << ct << ">(" << acc << ");\n";
        names_[r] = acc + "_sum";
      }
    }
    // Stores once per outer index, then stores that run along the reduced dims.
    std::vector<size_t> inner_stores;
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      const auto& st = k_.stores[s];
      if (depends_[st.expr] || strides_run_reduced(nest_.store_strides[s])) {
        inner_stores.push_back(s);
        continue;
      }
      emit_outer_deps(st.expr);
      emit_store(s, *body_, indent_);
    }
    if (inner_stores.empty()) return;
    for (size_t s : inner_stores) emit_outer_deps(k_.stores[s].expr);
    reduced_loops(
        [&](const std::string& indent) {
          std::vector<std::string> scope;
          if (stashed >= 0) {
            // Read back what the reduction loop stored instead of recomputing it.
            const auto& st = k_.stores[stash];
            names_[stashed] = "v" + std::to_string(stashed);
            *body_ << indent << "const " << compute_type(k_.exprs[stashed].dtype) << " " << names_[stashed] << " = buf"
                   << st.buffer << "[" << index(nest_.store_strides[stash], st.index.offset) << "];\n";
            scope_ids_.push_back(stashed);
          }
          for (size_t s : inner_stores) {
            emit_expr(k_.stores[s].expr, *body_, indent, scope);
            emit_store(s, *body_, indent);
          }
        },
        "");
  }

  // The value a reduction's accumulator starts from.
  std::string reduction_identity(const Expr& x) const {
    const std::string ct = compute_type(x.dtype);
    const bool floating = graph::is_floating_or_complex(x.dtype);
    switch (x.reduce_op) {
      case decomp::ReduceOp::Sum: return literal(0, x.dtype);
      case decomp::ReduceOp::Max:
        return floating ? "-std::numeric_limits<" + ct + ">::infinity()" : "std::numeric_limits<" + ct + ">::lowest()";
      case decomp::ReduceOp::Min:
        return floating ? "std::numeric_limits<" + ct + ">::infinity()" : "std::numeric_limits<" + ct + ">::max()";
    }
    return "";
  }

  // ---- column reductions ----------------------------------------------------------------------------
  // A sum over the OUTER dims of a row-major tensor (a bias gradient: [rows, columns] -> [columns]) walks
  // each column with a row-sized stride in the generic form: one cache line and, for large rows, one page
  // per element (18x-50x slower than ATen on [128, 2048] / [4096, 1024]). Instead each thread takes a block
  // of columns, keeps one accumulator per column, and walks the rows in order, reading each row's block
  // contiguously (vectorised over the columns). A channels-last pooling window is the same shape: the
  // channels are the columns, the window's elements the rows (3.4x slower than ATen in the generic form).

  // Applies when the innermost outer loop is the contiguous one and the reduced loops are strided: every
  // reduction is a sum (or the kernel pools a window: max too) and no load reads the innermost reduced loop
  // contiguously (then the generic form is already the fast one). Stores along the reduced loops (a fused pointwise prologue's result, a
  // normalisation's output) get one more walk over the rows after the reductions.
  bool column_reduction_applies() const {
    const int outer = nest_.outer_count;
    const int total = static_cast<int>(nest_.loops.size());
    if (outer == 0 || total == outer) return false;
    for (const Expr& x : k_.exprs)
      if (x.kind == ExprKind::Reduce && x.reduce_op != decomp::ReduceOp::Sum && !k_.window_reduction) return false;
    bool column_contiguous = false;
    for (size_t i = 0; i < k_.exprs.size(); ++i) {
      if (k_.exprs[i].kind != ExprKind::Load || !depends_[i]) continue;
      const std::vector<int64_t>& strides = nest_.load_strides[i];
      // a value per row, the same for every column (a layer norm's mean), may walk the rows contiguously
      if ((strides[total - 1] == 1 || strides[total - 1] == -1) && strides[outer - 1] != 0) return false;
      column_contiguous = column_contiguous || strides[outer - 1] == 1;
    }
    return column_contiguous;
  }

  // Opens loops `first_loop`.. (the reduced ones; none when first_loop is the loop count), then a vectorised
  // loop over the block's columns that defines the column loop variable; calls `body(indent)`; closes them
  // and forgets the names made inside.
  // With `blocks`, the innermost reduced loop walks its rows in blocks of kColumnSumRows: each block sums into
  // `part[j]` (float), then adds it to `total[j]` (double), as SumBlocks does for a row sum.
  void column_walk(std::ostream& out, const std::string& indent, int first_loop,
                   const std::function<void(const std::string&)>& body, const SumBlocks* blocks = nullptr) {
    const int total = static_cast<int>(nest_.loops.size());
    std::string inner = indent;
    for (int l = first_loop; l < total; ++l) {
      const std::string i = "i" + std::to_string(l);
      if (blocks && l == total - 1) {
        open_blocks(out, inner, l, kColumnSumRows);
        out << inner << "#pragma omp simd\n" << inner << "for (int64_t j = 0; j < count; ++j) " << blocks->part
            << "[j] = " << blocks->init << ";\n";
        out << inner << block_loop(l);
        inner += "  ";
        continue;
      }
      out << inner << "for (int64_t " << i << " = 0; " << i << " < " << loop_size(l) << "; ++" << i << ") {\n";
      inner += "  ";
    }
    out << inner << "#pragma omp simd\n" << inner << "for (int64_t j = 0; j < count; ++j) {\n";
    out << inner << "  const int64_t i" << nest_.outer_count - 1 << " = first + j;\n";
    scope_ids_.clear();
    body(inner + "  ");
    for (int32_t id : scope_ids_) names_[id].clear();
    scope_ids_.clear();
    out << inner << "}\n";
    for (int l = total - 1; l >= first_loop; --l) {
      inner.resize(inner.size() - 2);
      out << inner << "}\n";
      if (blocks && l == total - 1) {
        out << inner << "#pragma omp simd\n" << inner << "for (int64_t j = 0; j < count; ++j) " << blocks->total
            << "[j] += " << blocks->part << "[j];\n";
        inner.resize(inner.size() - 2);
        out << inner << "}\n";
      }
    }
  }

  void emit_column_reduction(std::ostream& out, bool parallel) {
    const int outer = nest_.outer_count;
    const int total = static_cast<int>(nest_.loops.size());
    const int column = outer - 1;
    const int64_t columns = nest_.loops[column].size;
    // Enough blocks for every thread (8 per 2-core machine at least), a block at most 2 KiB of float sums.
    int64_t block = ((columns + 7) / 8 + 15) / 16 * 16;
    block = std::max<int64_t>(16, std::min<int64_t>(kMaxColumnBlock, block));
    const int64_t blocks = (columns + block - 1) / block;
    const std::string columns_text = sizes_(columns);
    // With size arguments the block is a run-time value too, and the accumulators are sized for the largest one.
    const std::string block_text = sizes_(block);
    const int64_t extent = sizes_.enabled() ? kMaxColumnBlock : block;
    out << "  // column reduction: per block of " << block_text << " columns, rows walked contiguously\n";
    if (parallel)
      out << "  #pragma omp parallel for" << (outer > 1 ? " collapse(" + std::to_string(outer) + ")" : "") << parallel_if_ << "\n";
    std::string indent = "  ";
    for (int l = 0; l < column; ++l) {
      out << indent << "for (int64_t i" << l << " = 0; i" << l << " < " << loop_size(l) << "; ++i" << l << ") {\n";
      indent += "  ";
    }
    out << indent << "for (int64_t block = 0; block < " << sizes_(blocks) << "; ++block) {\n";
    indent += "  ";
    out << indent << "const int64_t first = block * " << block_text << ";\n";
    out << indent << "const int64_t count = " << columns_text << " - first < " << block_text << " ? " << columns_text
        << " - first : " << block_text << ";\n";
    // Stores along the reduced loops that use no reduction (a fused producer's result the sum reads too) are
    // made in the first reduction's walk over the rows.
    const std::vector<bool> after_reduction = fusion::uses_reductions(k_);
    auto along_reduced = [&](size_t s) { return depends_[k_.stores[s].expr] || strides_run_reduced(nest_.store_strides[s]); };
    std::vector<size_t> early;
    for (size_t s = 0; s < k_.stores.size(); ++s)
      if (along_reduced(s) && !after_reduction[k_.stores[s].expr]) early.push_back(s);
    bool first_reduction = true;
    for (size_t r = 0; r < k_.exprs.size(); ++r) {
      const Expr& x = k_.exprs[r];
      if (x.kind != ExprKind::Reduce) continue;
      const std::string acc = "acc" + std::to_string(r);
      const std::vector<size_t> with = first_reduction ? early : std::vector<size_t>{};
      first_reduction = false;
      // A float sum adds into `part` per block of rows, the blocks into the double `acc` (column_walk).
      const std::string ct = compute_type(x.dtype);
      const std::string at = accumulator_type(x);
      const bool blocked = at != ct && outer < total;
      const std::string part = acc + "_part";
      const SumBlocks blocks{part, ct, reduction_identity(x), acc};
      out << indent << at << " " << acc << "[" << extent << "];\n";
      if (blocked) out << indent << ct << " " << part << "[" << extent << "];\n";
      column_walk(out, indent, total, [&](const std::string& in) { out << in << acc << "[j] = " << reduction_identity(x) << ";\n"; });
      column_walk(out, indent, outer, [&](const std::string& in) {
        std::vector<std::string> scope;
        emit_expr(x.operands[0], out, in, scope);
        const std::string v = names_[x.operands[0]];
        for (size_t s : with) {
          emit_expr(k_.stores[s].expr, out, in, scope);
          emit_store(s, out, in);
        }
        if (x.reduce_op == decomp::ReduceOp::Sum) {
          out << in << (blocked ? part : acc) << "[j] += " << v << ";\n";
          return;
        }
        // A NaN sticks (nothing compares past it) and a new one is taken: NaN propagates like torch.amax.
        const char* cmp = x.reduce_op == decomp::ReduceOp::Max ? " > " : " < ";
        out << in << acc << "[j] = (" << v << " != " << v << " || " << v << cmp << acc << "[j]) ? " << v << " : " << acc
            << "[j];\n";
      }, blocked ? &blocks : nullptr);
      // read by later reductions and the stores, inside their column loops, as the compute type
      names_[r] = at == ct ? acc + "[j]" : "static_cast<" + ct + ">(" + acc + "[j])";
    }
    // Stores once per column, then the other stores along the reduced loops (both after every reduction).
    std::vector<size_t> outer_stores, inner_stores;
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      if (!along_reduced(s)) outer_stores.push_back(s);
      else if (std::find(early.begin(), early.end(), s) == early.end()) inner_stores.push_back(s);
    }
    for (int pass = 0; pass < 2; ++pass) {
      const std::vector<size_t>& stores = pass == 0 ? outer_stores : inner_stores;
      if (stores.empty()) continue;
      column_walk(out, indent, pass == 0 ? total : outer, [&](const std::string& in) {
        std::vector<std::string> scope;
        for (size_t s : stores) {
          emit_expr(k_.stores[s].expr, out, in, scope);
          emit_store(s, out, in);
        }
      });
    }
    for (int l = column; l >= 0; --l) {
      indent.resize(indent.size() - 2);
      out << indent << "}\n";
    }
  }

  void emit_store(size_t s, std::ostream& out, const std::string& indent) {
    const auto& st = k_.stores[s];
    const auto& buf = k_.buffers[st.buffer];
    if (!tile_slot_.empty()) {  // a register-transposed tile (emit_tiled)
      out << indent << "tile" << s << tile_slot_ << " = kiln_store_as<float>::from(" << names_[st.expr] << ");\n";
      return;
    }
    out << indent << "buf" << st.buffer << "[" << index(nest_.store_strides[s], st.index.offset) << "] = kiln_store_as<"
        << storage_type(buf.dtype) << ">::from(" << names_[st.expr] << ");\n";
  }

  const Kernel& k_;
  const graph::Graph& g_;
  fusion::LoopNest nest_;
  std::vector<bool> depends_;
  mutable SizeArguments sizes_;  // literals, or the kernel's size slots (codegen/size_arguments.h)
  size_t slots_at_ = 0;  // where the slots' declarations go: after the buffers'
  std::string parallel_if_;  // with size arguments: the run-time test on OpenMP's parallel pragmas
  std::vector<std::string> names_;
  std::vector<int32_t> scope_ids_;  // names made inside the current reduced loop
  std::ostringstream* body_ = nullptr;
  std::string indent_;
  std::string tile_slot_;  // non-empty: stores go to local tiles at this subscript (emit_tiled)
};

}  // namespace

std::string emit_cpp_kernel(const Kernel& kernel, const graph::Graph& g, bool size_arguments, std::vector<int64_t>* sizes) {
  std::vector<int64_t> values;
  std::string text = KernelEmitter(kernel, g, size_arguments).emit(values);
  if (sizes) *sizes = std::move(values);
  return text;
}

namespace {

// A kernel's code without the graph value ids its buffer declarations name in comments ("  // %12").
std::string without_value_comments(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 6, "  // %") == 0) {
      size_t j = i + 6;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
      if (j < text.size() && text[j] == '\n') {
        i = j - 1;
        continue;
      }
    }
    out += text[i];
  }
  return out;
}

}  // namespace

CppSource emit_cpp_source(const fusion::Schedule& schedule, const graph::Graph& g, bool size_arguments) {
  // The g++ time of a graph grows with its source: a 6-block transformer has 19 CPU kernels, 4 distinct.
  CppSource result;
  std::ostringstream out;
  out << device_lib::cpp_prelude() << "\n";
  std::unordered_map<std::string, std::string> function_of_body;  // code after the name -> the function
  result.functions.resize(schedule.kernels.size());
  result.sizes.resize(schedule.kernels.size());
  for (const fusion::Step& step : schedule.steps) {
    if (step.kind != fusion::Step::Kind::Kernel) continue;
    const fusion::Kernel& kernel = schedule.kernels[step.index];
    const std::string text = emit_cpp_kernel(kernel, g, size_arguments, &result.sizes[step.index]);
    const std::string signature = "extern \"C\" void " + kernel.name + "(";
    const size_t at = text.find(signature);
    KILN_ASSERT(at != std::string::npos);
    auto [it, fresh] = function_of_body.emplace(without_value_comments(text.substr(at + signature.size())), kernel.name);
    result.functions[step.index] = it->second;
    if (fresh) out << "\n" << text;
    else out << "\n" << text.substr(0, at) << "// runs as " << it->second << " (the same code)\n";
  }
  result.text = out.str();
  return result;
}

}  // namespace kiln::codegen::cpp
