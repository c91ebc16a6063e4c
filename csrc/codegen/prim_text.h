#pragma once
// Text helpers both code generators (codegen/cpp, codegen/cuda) use to turn loop-IR expressions into source.
// Torch-free.
#include <string>
#include <vector>

#include "fusion/loop_ir.h"

namespace kiln::codegen {

/// `text` with every occurrence of `key` replaced by `value`.
std::string substitute(std::string text, const std::string& key, const std::string& value);

/// The expression whose compute type a Unary/Binary/Where expression's `$T` names: its first operand, or
/// the second for Where (the first is the condition).
int32_t typed_operand(const fusion::Expr& x);

/// A Unary, Binary or Where expression's source: the prim's `format` with `$T` replaced by `operand_type`
/// and `$a`, `$b`, `$c` by the names (indexed by expression) of `x`'s operands.
std::string fill_prim_format(std::string format, const fusion::Expr& x, const std::string& operand_type,
                             const std::vector<std::string>& names);

}  // namespace kiln::codegen
