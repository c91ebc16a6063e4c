#include "codegen/prim_text.h"

namespace kiln::codegen {

std::string substitute(std::string text, const std::string& key, const std::string& value) {
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + value.size()))
    text.replace(at, key.size(), value);
  return text;
}

int32_t typed_operand(const fusion::Expr& x) { return x.operands[x.kind == fusion::ExprKind::Where ? 1 : 0]; }

std::string fill_prim_format(std::string format, const fusion::Expr& x, const std::string& operand_type,
                             const std::vector<std::string>& names) {
  format = substitute(std::move(format), "$T", operand_type);
  for (int i = 0; i < 3; ++i)
    if (x.operands[i] >= 0) format = substitute(std::move(format), std::string("$") + static_cast<char>('a' + i), names[x.operands[i]]);
  return format;
}

}  // namespace kiln::codegen
