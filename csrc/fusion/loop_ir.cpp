// Loop-IR checks and summaries (fusion/loop_ir.h).
#include "fusion/loop_ir.h"

#include <sstream>

#include "common/error.h"

namespace kiln::fusion {

using graph::ScalarType;

std::string Schedule::summary() const {
  std::ostringstream out;
  int kernel_count = 0, extern_count = 0;
  for (const Step& s : steps) (s.kind == Step::Kind::Kernel ? kernel_count : extern_count)++;
  out << kernel_count << " kernels, " << extern_count << " extern calls";
  return out.str();
}

void verify_kernel(const Kernel& k) {
  KILN_ASSERT_EQ(k.reduced.size(), k.domain.size()) << "kernel " << k.name << ": reduced mask rank";
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    for (int32_t op : e.operands)
      KILN_ASSERT(op < static_cast<int32_t>(i)) << "kernel " << k.name << ": expression " << i
                                                 << " uses a later expression " << op;
    if (e.kind == ExprKind::Load) {
      KILN_ASSERT(e.buffer >= 0 && e.buffer < static_cast<int32_t>(k.buffers.size()))
          << "kernel " << k.name << ": expression " << i << " loads an unknown buffer";
      KILN_ASSERT_EQ(e.index.strides.size(), k.domain.size()) << "kernel " << k.name << ": index rank of load " << i;
      KILN_ASSERT(e.operands[0] < 0 || k.exprs[e.operands[0]].dtype == ScalarType::Bool)
          << "kernel " << k.name << ": load " << i << " is guarded by a value that is not bool";
      KILN_ASSERT(e.operands[1] < 0 || (!graph::is_floating_or_complex(k.exprs[e.operands[1]].dtype) &&
                                        k.exprs[e.operands[1]].dtype != ScalarType::Bool && e.gather_extent > 0))
          << "kernel " << k.name << ": gathered load " << i << " needs an integer index and an extent";
    }
    if (e.kind == ExprKind::Iota) {
      KILN_ASSERT_EQ(e.index.strides.size(), k.domain.size()) << "kernel " << k.name << ": index rank of iota " << i;
      KILN_ASSERT(e.dtype == ScalarType::Long) << "kernel " << k.name << ": iota " << i << " is not int64";
    }
    if (e.kind == ExprKind::InBounds) {
      KILN_ASSERT(!e.bounds.empty()) << "kernel " << k.name << ": bounds predicate " << i << " has no bounds";
      for (const Bound& b : e.bounds)
        KILN_ASSERT_EQ(b.index.strides.size(), k.domain.size()) << "kernel " << k.name << ": index rank of bounds " << i;
    }
  }
  for (const Store& s : k.stores) {
    KILN_ASSERT(s.expr >= 0 && s.expr < static_cast<int32_t>(k.exprs.size())) << "kernel " << k.name << ": store of an unknown expression";
    KILN_ASSERT(k.buffers[s.buffer].is_output) << "kernel " << k.name << ": store into an input buffer";
  }
}

}  // namespace kiln::fusion
