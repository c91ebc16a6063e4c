#pragma once
// The bytecode layer: decode a code object into an editable instruction list and assemble it back
// (EXTENDED_ARG fixpoint, inline CACHE units, exception table, line table, stack depth).
//
// Opcode numbers are never hard-coded: they come from the running interpreter's `opcode`/`dis`
// modules (3.13 renumbers everything), read once into OpcodeTable. Everything here needs the GIL.
// Torch-free (DESIGN.md: bytecode/ knows nothing about torch).
#include <Python.h>

#include <array>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kiln::bytecode {

struct Positions {
  int line = -1, end_line = -1, col = -1, end_col = -1;  // -1 = none
  bool operator==(const Positions& o) const {
    return line == o.line && end_line == o.end_line && col == o.col && end_col == o.end_col;
  }
  bool operator!=(const Positions& o) const { return !(*this == o); }
};

struct Instruction {
  int opcode = 0;            // base (de-specialised) opcode number of the running Python
  int arg = 0;               // full argument, EXTENDED_ARG folded in (jumps: recomputed from `target`)
  int target = -1;           // jumps: index of the target instruction in the vector, else -1
  int offset = -1;           // code-unit offset of the instruction's first unit (its first EXTENDED_ARG
                             // prefix when it has one) in the decoded code; -1 for created instructions
  Positions pos;             // from the line table
  bool starts_line = false;  // informational: first instruction of a new source line
};

/// One exception-table row in instruction indices: instructions [start, end) jump to `target` with the
/// value stack cut to `depth` (plus the offset of the raising instruction when `lasti`).
struct ExceptionEntry {
  int start = 0, end = 0, target = 0;
  int depth = 0;
  bool lasti = false;
};

struct CodeInstructions {
  std::vector<Instruction> instructions;  // no EXTENDED_ARG and no CACHE entries: those are implicit
  std::vector<ExceptionEntry> exception_table;
  int firstlineno = 0;
};

/// Opcode facts of the running interpreter, read from `opcode`/`dis` at first use.
struct OpcodeTable {
  static constexpr int kCount = 256;
  struct Info {
    const char* name = nullptr;  // nullptr: not a (base) opcode of this version
    int base = -1;               // de-specialised / de-instrumented opcode (self for base opcodes)
    int caches = 0;              // inline CACHE units after the instruction
    bool has_arg = false, is_jump = false, is_backward_jump = false;
    bool is_terminator = false;  // never falls through (return, raise, reraise, unconditional jump)
    bool has_const = false, has_name = false, has_local = false, has_free = false;
  };

  /// Opcode number for `name`, or -1 when this Python has no such opcode.
  int op(std::string_view name) const;
  /// Name of opcode `op` ("<N>" for numbers this version does not use).
  const char* name(int op) const;
  int caches(int op) const { return info(op).caches; }
  bool is_jump(int op) const { return info(op).is_jump; }
  bool is_backward_jump(int op) const { return info(op).is_backward_jump; }
  bool is_terminator(int op) const { return info(op).is_terminator; }
  bool has_arg(int op) const { return info(op).has_arg; }
  bool has_const(int op) const { return info(op).has_const; }
  bool has_name(int op) const { return info(op).has_name; }
  bool has_local(int op) const { return info(op).has_local; }
  bool has_free(int op) const { return info(op).has_free; }
  /// Maps specialised/instrumented opcodes to their base; base opcodes map to themselves.
  int base(int op) const { return info(op).base; }
  /// Net stack effect (PyCompile_OpcodeStackEffectWithJump); `jump` selects the branch-taken path.
  int stack_effect(int op, int arg, bool jump) const;
  const Info& info(int op) const;

  int extended_arg = -1, cache = -1, nop = -1;

  static constexpr int kNoOverride = 1 << 20;
  std::array<int, kCount> fallthrough_effect_override;  // see kEffectOverrides in opcodes.cpp

  std::array<Info, kCount> infos;
  std::array<std::string, kCount> names;  // owns the strings Info::name points to
  std::unordered_map<std::string, int> by_name;
};

/// The running interpreter's table (built on first call; needs the GIL).
const OpcodeTable& opcodes();

/// Decodes `code` (its de-specialised co_code, exception table and line table).
/// Throws kiln::Error on malformed input.
CodeInstructions decode(PyCodeObject* code);

struct Assembled {
  std::string code, exception_table, line_table;
  int stacksize = 0;
};

/// Lays the instructions out: jump args from targets, EXTENDED_ARG prefixes to a fixpoint, zeroed CACHE
/// units, exception and line tables (lines relative to `firstlineno`), and stack_depth().
Assembled assemble(const CodeInstructions& ci, int firstlineno);

/// Maximum value-stack depth over all paths, exception handlers included.
/// Throws kiln::Error when two paths reach an instruction with different depths.
int stack_depth(const CodeInstructions& ci);

/// New reference: original.replace(co_code=..., co_exceptiontable=..., co_linetable=...,
/// co_stacksize=..., **replace_kwargs). `replace_kwargs` may be NULL; a co_firstlineno in it is
/// used to encode the line table. Throws kiln::Error (with the Python error cleared) on failure.
PyObject* make_code(PyCodeObject* original, const CodeInstructions& ci, PyObject* replace_kwargs);

/// Readable listing (KILN_LOGS=bytecode): index, offset, line, opcode, arg, jump target, handlers.
std::string format(const CodeInstructions& ci);

/// Index of the instruction covering code unit `unit` of the decoded code (prefix, opcode or cache
/// unit), or -1. For mapping a frame's instruction pointer back to the instruction list.
int instruction_at_offset(const CodeInstructions& ci, int unit);

/// Size in code units of `opcode` with argument `arg` (EXTENDED_ARG prefixes + opcode + caches).
int instruction_size(int opcode, int arg);

// --- table encodings, exposed for tests ----------------------------------------------------------

/// Exception-table row in code units, as stored in co_exceptiontable.
struct RawExceptionEntry {
  int start = 0, size = 0, target = 0, depth = 0;
  bool lasti = false;
  bool operator==(const RawExceptionEntry& o) const {
    return start == o.start && size == o.size && target == o.target && depth == o.depth && lasti == o.lasti;
  }
};
/// Varint of 6-bit chunks, most significant first, 0x40 = more follows, `first_bit` (0x80) on byte 1.
void append_exception_varint(std::string& out, unsigned value, unsigned char first_bit);
std::string encode_exception_table(const std::vector<RawExceptionEntry>& entries);
std::vector<RawExceptionEntry> decode_exception_table(std::string_view bytes);

/// Line-table varint: 6-bit chunks, least significant first, 0x40 = more follows.
void append_line_varint(std::string& out, unsigned value);
/// Signed: (v << 1) for v >= 0, ((-v) << 1) | 1 for v < 0.
void append_line_signed_varint(std::string& out, int value);
/// Per-code-unit positions of a line table covering `code_units` units.
std::vector<Positions> decode_line_table(std::string_view bytes, int firstlineno, int code_units);
/// A run of `units` code units sharing one location; runs longer than 8 units are split into entries.
struct LocationRun {
  Positions pos;
  int units = 0;
};
std::string encode_line_table(const std::vector<LocationRun>& runs, int firstlineno);

}  // namespace kiln::bytecode
