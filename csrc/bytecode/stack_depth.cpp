// stack_depth(): the deepest value stack any path reaches, for co_stacksize (which CPython does not
// validate: too small corrupts the frame). Walks the instruction graph from the entry with the
// interpreter's own per-opcode effects (PyCompile_OpcodeStackEffectWithJump); an exception handler
// starts at its entry's depth, plus the pushed lasti when `lasti`, plus the exception itself.
#include <algorithm>

#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::bytecode {

int stack_depth(const CodeInstructions& ci) {
  const OpcodeTable& ops = opcodes();
  const std::vector<Instruction>& instrs = ci.instructions;
  const int n = static_cast<int>(instrs.size());
  if (n == 0) return 0;

  // Handlers covering each instruction (CPython's tables never overlap; edited ones may).
  std::vector<std::vector<int>> handlers(n);
  for (int e = 0; e < static_cast<int>(ci.exception_table.size()); ++e) {
    const ExceptionEntry& entry = ci.exception_table[e];
    KILN_CHECK(entry.start >= 0 && entry.end <= n && entry.target >= 0 && entry.target < n)
        << "exception entry " << e << " out of range";
    for (int i = entry.start; i < entry.end; ++i) handlers[i].push_back(e);
  }

  std::vector<int> depth(n, -1);
  std::vector<int> work;
  int max_depth = 0;
  auto reach = [&](int from, int to, int d) {
    KILN_CHECK(to < n) << "instruction " << from << " (" << ops.name(instrs[from].opcode)
                       << ") falls off the end of the code";
    KILN_CHECK(d >= 0) << "stack underflow reaching instruction " << to << " from " << from << " ("
                       << ops.name(instrs[from].opcode) << ")";
    max_depth = std::max(max_depth, d);
    if (depth[to] < 0) {
      depth[to] = d;
      work.push_back(to);
    } else {
      KILN_CHECK(depth[to] == d) << "inconsistent stack depth at instruction " << to << " ("
                                 << ops.name(instrs[to].opcode) << "): " << depth[to] << " and " << d
                                 << " (reached from " << from << ")";
    }
  };
  depth[0] = 0;
  work.push_back(0);
  while (!work.empty()) {
    int i = work.back();
    work.pop_back();
    const Instruction& instr = instrs[i];
    const int d = depth[i];
    for (int e : handlers[i]) {
      const ExceptionEntry& entry = ci.exception_table[e];
      KILN_CHECK(entry.depth <= d) << "exception entry " << e << " keeps " << entry.depth
                                   << " stack items but instruction " << i << " has only " << d;
      reach(i, entry.target, entry.depth + (entry.lasti ? 1 : 0) + 1);
    }
    if (ops.is_jump(instr.opcode)) reach(i, instr.target, d + ops.stack_effect(instr.opcode, instr.arg, true));
    if (!ops.is_terminator(instr.opcode)) reach(i, i + 1, d + ops.stack_effect(instr.opcode, instr.arg, false));
  }
  return max_depth;
}

}  // namespace kiln::bytecode
