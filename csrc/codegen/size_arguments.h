#pragma once
// Size arguments (issue #25): the integers of a generated kernel that come from its sizes -- the loop IR's sizes,
// strides, offsets, bounds and gather extents, and what the emitters derive from them (trip counts, products for
// index decomposition, vector counts) -- printed as literals, or, for the graphs a DynamicGraph compiles per binding
// (compile::CompileOptions::size_arguments), read at run time from a per-kernel array of int64 values, so that every
// binding whose schedule decisions agree generates the same source and finds it in the kernel caches.
//
// The emitters ask for each such integer where they print it; the slots are numbered in the order they are asked
// for, which the emitter's decisions fix: two bindings with the same decisions ask in the same order, and each
// binding's values (cache::KernelEntry::sizes) fill its own launches. Decisions themselves (loop structure, vector
// widths, index width, which strides are 0 or 1, array extents) stay in the source: a binding that decides otherwise
// gets a source of its own. Only integers that the emitted code uses as plain run-time values may become slots.
//
// Torch-free.
#include <cstdint>
#include <string>
#include <vector>

#include "fusion/loop_ir.h"

namespace kiln::codegen {

class SizeArguments {
 public:
  /// `enabled`: slots, else literals. Slots are named `<prefix><k>` (the emitter declares them from values()).
  explicit SizeArguments(bool enabled, std::string prefix = "sz") : enabled_(enabled), prefix_(std::move(prefix)) {}

  bool enabled() const { return enabled_; }
  /// `v` where the emitted code reads it: `literal` when disabled; else the name of a new slot holding `v`.
  std::string operator()(int64_t v, const std::string& literal) {
    if (!enabled_) return literal;
    values_.push_back(v);
    return prefix_ + std::to_string(values_.size() - 1);
  }
  /// `v` in decimal where disabled.
  std::string operator()(int64_t v) { return (*this)(v, std::to_string(v)); }
  /// A stride or an offset: 0, 1 and -1 stay literals in either mode (they are decisions: an access that does not
  /// move or starts at the buffer's first element, or walks contiguously, which vectorisation and the emitters'
  /// choices rely on); others as operator().
  std::string stride(int64_t v, const std::string& literal) {
    return v >= -1 && v <= 1 ? literal : (*this)(v, literal);
  }
  /// Constant expression `e` of `k` as the compute type `type` spells it, where it is a slot: a size constant
  /// (is_size_constant) while enabled; else "" (the caller prints its literal).
  std::string constant(const fusion::Kernel& k, int32_t e, const std::string& type) {
    if (!enabled_ || !is_size_constant(k, e)) return "";
    return "static_cast<" + type + ">(" + (*this)(static_cast<int64_t>(k.exprs[e].constant), "") + ")";
  }
  /// True when constant `e` divides (the second operand of a Div) or bounds a checked index (CheckedIndex's extent)
  /// and is a whole number in [2, 2^31): the element count that mean and var divide by, or a dim's size, which
  /// decompositions write as a constant. Such a constant is a slot, exact (the whole number converts to the compute
  /// type as its literal would), so a mean over a dynamic dim keeps one source; other constants stay literals
  /// (`x ** 2` keeps its constant exponent).
  static bool is_size_constant(const fusion::Kernel& k, int32_t e) {
    const fusion::Expr& c = k.exprs[e];
    if (c.kind != fusion::ExprKind::Constant || c.dtype == graph::ScalarType::Bool) return false;
    if (!(c.constant >= 2 && c.constant < 2147483648.0) || c.constant != static_cast<double>(static_cast<int64_t>(c.constant)))
      return false;
    for (const fusion::Expr& x : k.exprs)
      if (x.kind == fusion::ExprKind::Binary && x.operands[1] == e &&
          (x.op == decomp::PrimOp::Div || x.op == decomp::PrimOp::CheckedIndex))
        return true;
    return false;
  }
  /// The slots' values, in slot order.
  const std::vector<int64_t>& values() const { return values_; }
  const std::string& prefix() const { return prefix_; }

 private:
  bool enabled_;
  std::string prefix_;
  std::vector<int64_t> values_;
};

}  // namespace kiln::codegen
