"""kiln._core.bytecode against CPython itself: every code object of the standard library must
decode and assemble back to identical bytes, and rebuilt or edited functions must behave identically.
Runs without torch (3.11 with torch, 3.12 and 3.13 without)."""
import asyncio
import contextlib
import dis
import importlib.util
import os
import sys
import types

import pytest

from kiln import _core

bc = _core.bytecode

# Modules whose import has side effects or that need a GUI; compiling them is harmless, but the brief
# for this suite keeps them out anyway, so the set checked is the same on every machine.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test"}
# Test-data folders inside packages (lib2to3's fixtures are deliberately not valid Python 3).
SKIPPED_DIRS = {"test", "tests", "idle_test", "__pycache__", "data"}


def _module_files():
    """Source files of the pure-Python stdlib modules found through sys.stdlib_module_names."""
    files = []
    for name in sorted(sys.stdlib_module_names):
        if name in SKIPPED_MODULES or name.startswith("turtle"):
            continue
        try:
            spec = importlib.util.find_spec(name)  # top-level: locates without executing anything
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                for root, dirs, names in os.walk(location):
                    dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
                    files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
        elif spec.origin and spec.origin.endswith(".py"):
            files.append(spec.origin)
    return files


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _stdlib_code_objects():
    """Module code objects compiled from source exactly as the import system compiles them
    (no execution, so no import side effects); sources that do not compile are skipped."""
    codes = []
    for path in _module_files():
        try:
            with open(path, "rb") as f:
                source = f.read()
            module_code = compile(source, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
            continue
        codes.extend(_code_objects(module_code))
    return codes


def test_stdlib_code_objects_round_trip_byte_for_byte():
    codes = _stdlib_code_objects()
    mismatches = {"co_code": [], "co_exceptiontable": [], "co_linetable": [], "positions": [], "stacksize": []}
    for code in codes:
        rebuilt = bc.roundtrip(code)
        for attr in ("co_code", "co_exceptiontable", "co_linetable"):
            if getattr(rebuilt, attr) != getattr(code, attr):
                mismatches[attr].append(code)
        if list(rebuilt.co_positions()) != list(code.co_positions()):
            mismatches["positions"].append(code)
        # make_code sets co_stacksize from stack_depth(). On CPython 3.11.7, 3.12.1 and 3.13.0 it equals
        # the compiler's co_stacksize for every stdlib code object (0 over-estimates), so demand equality.
        if rebuilt.co_stacksize != code.co_stacksize:
            mismatches["stacksize"].append((code, rebuilt.co_stacksize))
    print(f"\nkiln bytecode: {len(codes)} stdlib code objects round-tripped on Python {sys.version.split()[0]}")
    assert len(codes) > 10000
    assert {k: v[:3] for k, v in mismatches.items() if v} == {}


def test_instructions_agree_with_dis():
    def sample(xs, flag):
        total = 0
        for x in xs:
            if x > 2 and flag:
                total += x
            elif x is None:
                continue
            else:
                total -= 1
        while total > 100:
            total //= 2
        return total

    real = [i for i in dis.get_instructions(sample) if i.opname not in ("EXTENDED_ARG", "CACHE")]
    ours = bc.instructions(sample.__code__)
    assert [o[0] for o in ours] == [r.opname for r in real]
    by_index = {index: r for index, r in enumerate(real)}
    for index, (opname, arg, target, offset, line) in enumerate(ours):
        r = by_index[index]
        assert offset * 2 == r.offset, opname
        if target >= 0:
            # dis reports jump targets as byte offsets; ours is the index of that instruction.
            assert by_index[target].offset == r.argval, opname
        elif r.arg is not None:
            assert arg == r.arg, opname
        expected_line = r.positions.lineno if r.positions and r.positions.lineno is not None else -1
        assert line == expected_line, opname
    assert "exception table" not in bc.format(sample.__code__)


def test_exception_table_is_in_instruction_indices():
    def guarded(x):
        try:
            return 1 / x
        except ZeroDivisionError:
            return None

    ours = bc.instructions(guarded.__code__)
    table = bc.exception_table(guarded.__code__)
    assert table, "a try block has an exception table"
    for start, end, target, depth, lasti in table:
        assert 0 <= start < end <= len(ours) and 0 <= target < len(ours)
    # The first handler's first instruction is PUSH_EXC_INFO in 3.11-3.13.
    assert ours[table[0][2]][0] == "PUSH_EXC_INFO"
    assert "exception table:" in bc.format(guarded.__code__)


# --- behaviour: rebuilt and edited functions run exactly like the originals ------------------------

def _rebuild(fn, code):
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# Pairs the interpreter needs adjacent (assemble() enforces them): no NOP goes between them.
_KEEP_ADJACENT_AFTER = {"PRECALL", "YIELD_VALUE", "END_FOR"}


def _interleave_nops(code):
    """Every instruction after the prologue (up to the first RESUME) gets a NOP in front of it, except
    where the interpreter needs two instructions adjacent; jumps and handlers land on the NOPs (a
    FOR_ITER still lands on its END_FOR). Moves every offset, so every jump arg changes."""
    ours = bc.instructions(code)
    resume = next(i for i, o in enumerate(ours) if o[0] == "RESUME")
    for_iter_targets = {o[2] for o in ours if o[0] == "FOR_ITER"}
    new_index = []
    out = []
    for i, (opname, arg, target, _offset, _line) in enumerate(ours):
        pad = i > resume and ours[i - 1][0] not in _KEEP_ADJACENT_AFTER and i not in for_iter_targets
        if pad:
            out.append(["NOP", 0, -1, i])
        new_index.append(len(out) - 1 if pad else len(out))
        out.append([opname, arg, target, i])
    new_index.append(len(out))
    for instr in out:
        if instr[2] >= 0:
            instr[2] = new_index[instr[2]]
    table = [(new_index[s], new_index[e], new_index[t], d, lasti) for s, e, t, d, lasti in bc.exception_table(code)]
    return bc.assemble_code(code, [tuple(i) for i in out], table)


def _insert(code, at, new_instructions):
    """Inserts (opname, arg) pairs before instruction `at`; they join its handler and its line, and
    jumps to `at` now land on them."""
    ours = bc.instructions(code)
    n = len(new_instructions)

    def moved(index, inclusive):
        return index + n if (index > at or (inclusive and index == at)) else index

    out = []
    for i, (opname, arg, target, _offset, _line) in enumerate(ours):
        if i == at:
            out.extend((name, a, -1, at) for name, a in new_instructions)
        out.append((opname, arg, moved(target, False) if target >= 0 else -1, i))
    table = [(moved(s, False), moved(e, False), moved(t, False), d, lasti)
             for s, e, t, d, lasti in bc.exception_table(code)]
    return bc.assemble_code(code, out, table)


def loops(n):
    total = 0
    for i in range(n):
        if i % 3 == 0:
            continue
        if i > 50:
            break
        total += i
    j = 0
    while j < n:
        j += 7
    return total, j


def exceptions(x):
    log = []
    try:
        try:
            log.append(10 // x)
        except ZeroDivisionError as e:
            log.append(type(e).__name__)
            raise ValueError("wrapped") from e
        else:
            log.append("else")
        finally:
            log.append("finally")
    except ValueError as e:
        log.append(str(e))
    return log


class _Resource:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", exc[0].__name__ if exc[0] else None))
        return exc[0] is KeyError


def with_blocks(fail):
    log = []
    with _Resource(log) as r, contextlib.suppress(IndexError):
        log.append(r is not None)
        if fail == "key":
            raise KeyError(fail)
        if fail == "index":
            [][1]
    return log


def generator(n):
    sent = yield "start"
    for i in range(n):
        sent = yield (i, sent)
    yield from range(3)
    return "done"


def comprehensions(xs):
    squares = [x * x for x in xs if x % 2]
    table = {x: [y for y in range(x)] for x in xs[:4]}
    gen_sum = sum(x for x in xs if x > 2)
    return squares, table, gen_sum, {x % 3 for x in xs}


def closures(base):
    counter = 0

    def bump(step=1):
        nonlocal counter
        counter += step + base
        return counter

    bump()
    bump(5)
    return counter, (lambda k: k + base + counter)(2)


async def _async_helper(x):
    await asyncio.sleep(0)
    return x * 2


async def coroutine(xs):
    out = []
    for x in xs:
        out.append(await _async_helper(x))
    async with contextlib.AsyncExitStack():
        out.append("async-with")
    return out


def match_statement(value):
    match value:
        case [x, y, *rest]:
            return ("seq", x, y, len(rest))
        case {"k": v}:
            return ("map", v)
        case int(n) if n > 3:
            return ("big", n)
        case _:
            return ("other", value)


def _make_function(source, name):
    namespace = {}
    exec(compile(source, f"<generated {name}>", "exec"), namespace)
    return namespace[name]


def many_locals_and_consts():
    """> 256 locals and > 256 constants: LOAD_FAST / STORE_FAST / LOAD_CONST need EXTENDED_ARG."""
    lines = [f"    v{i} = {i * 1000 + 7}.5" for i in range(300)]
    lines.append("    return " + " + ".join(f"v{i}" for i in range(0, 300, 7)) + ", v299, v256")
    return _make_function("def f():\n" + "\n".join(lines) + "\n", "f")


def long_jumps():
    """Loop bodies and branches of several hundred code units: jumps need EXTENDED_ARG."""
    def body(indent):
        return "".join(f"{indent}acc = (acc * 31 + i * {k}) % 1000003\n" for k in range(120))

    source = ("def f(n, flag):\n"
              "    acc = 0\n"
              "    for i in range(n):\n"
              + body(" " * 8) +
              "        if flag and i == 2:\n"
              "            break\n"
              "    if n > 1:\n"
              "        i = n\n"
              + body(" " * 8) +
              "    return acc\n")
    return _make_function(source, "f")


def _call(fn, *args):
    """Result or exception (type, message) — both must match between original and rebuilt."""
    try:
        result = fn(*args)
        if isinstance(result, types.GeneratorType):
            out = [next(result)]
            with contextlib.suppress(StopIteration):
                while True:
                    out.append(result.send(len(out)))
            return out
        if isinstance(result, types.CoroutineType):
            return asyncio.run(result)
        return result
    except Exception as e:  # noqa: BLE001 — the exception is the observed behaviour
        return ("raised", type(e).__name__, str(e))


BEHAVIOUR_CASES = [
    (loops, [(0,), (10,), (100,)]),
    (exceptions, [(0,), (2,)]),
    (with_blocks, [(None,), ("key",), ("index",)]),
    (generator, [(0,), (4,)]),
    (comprehensions, [([1, 2, 3, 4, 5, 6],), ([],)]),
    (closures, [(1,), (10,)]),
    (coroutine, [([1, 2, 3],)]),
    (match_statement, [([1, 2, 3],), ({"k": 9},), (7,), ("s",)]),
    (many_locals_and_consts(), [()]),
    (long_jumps(), [(0, False), (5, True), (9, False)]),
]


def _has_extended_arg(fn):
    return any(i.opname == "EXTENDED_ARG" for i in dis.get_instructions(fn))


def test_generated_functions_really_need_extended_arg():
    for fn in (many_locals_and_consts(), long_jumps()):
        assert _has_extended_arg(fn), fn


@pytest.mark.parametrize("fn,arg_sets", BEHAVIOUR_CASES, ids=[c[0].__name__ + str(i) for i, c in
                                                                enumerate(BEHAVIOUR_CASES)])
def test_rebuilt_functions_behave_identically(fn, arg_sets):
    rebuilt = _rebuild(fn, bc.roundtrip(fn.__code__))
    nops = _rebuild(fn, _interleave_nops(fn.__code__))
    assert rebuilt.__code__.co_code == fn.__code__.co_code
    assert len(nops.__code__.co_code) > len(fn.__code__.co_code)
    for args in arg_sets:
        expected = _call(fn, *args)
        assert _call(rebuilt, *args) == expected, args
        assert _call(nops, *args) == expected, args


def test_nested_code_objects_rebuild_too():
    # The closure's inner function and the comprehension are code objects in co_consts.
    for code in _code_objects(closures.__code__):
        assert bc.roundtrip(code).co_code == code.co_code


def test_edit_inside_long_loop_keeps_behaviour():
    fn = long_jumps()
    ours = bc.instructions(fn.__code__)
    # Middle of the first loop body: between the FOR_ITER and its backward jump.
    for_iter = next(i for i, o in enumerate(ours) if o[0] == "FOR_ITER")
    back = next(i for i, o in enumerate(ours) if o[0].startswith("JUMP_BACKWARD") and o[2] <= for_iter)
    at = (for_iter + back) // 2
    const_index = fn.__code__.co_consts.index(0) if 0 in fn.__code__.co_consts else 0
    padding = [("LOAD_CONST", const_index), ("POP_TOP", 0)] * 80 + [("NOP", 0)] * 40
    edited = _rebuild(fn, _insert(fn.__code__, at, padding))
    edited_ops = bc.instructions(edited.__code__)
    assert len(edited_ops) == len(ours) + len(padding)
    # The backward jump now spans the padding too and needs a longer argument than before.
    old_arg = ours[back][1]
    new_back = back + len(padding)
    assert edited_ops[new_back][0] == ours[back][0] and edited_ops[new_back][1] > old_arg
    for args in [(0, False), (6, True), (9, False)]:
        assert edited(*args) == fn(*args)


def test_edit_inside_try_block_keeps_handler():
    ours = bc.instructions(exceptions.__code__)
    divide = next(i for i, o in enumerate(ours) if o[0] == "BINARY_OP")
    edited = _rebuild(exceptions, _insert(exceptions.__code__, divide, [("NOP", 0)] * 300))
    assert edited(0) == exceptions(0) and edited(5) == exceptions(5)


def test_stack_depth_matches_compiler():
    for fn, _ in BEHAVIOUR_CASES:
        for code in _code_objects(fn.__code__):
            assert bc.stack_depth(code) == code.co_stacksize, code


def test_malformed_edits_are_rejected():
    code = loops.__code__
    ours = bc.instructions(code)
    jump = next(i for i, o in enumerate(ours) if o[2] >= 0)
    bad_target = [(o[0], o[1], (len(ours) + 5) if i == jump else o[2], i) for i, o in enumerate(ours)]
    with pytest.raises(Exception, match="target"):
        bc.assemble_code(code, bad_target, [])
    with pytest.raises(Exception, match="no opcode"):
        bc.assemble_code(code, [("NOT_AN_OPCODE", 0, -1, -1)], [])
    with pytest.raises(Exception, match="code object"):
        bc.roundtrip(42)
    # An extra value pushed on every iteration makes the loop head's depth differ between its entry
    # and its back edge.
    back = next(i for i, o in enumerate(ours) if o[0].startswith("JUMP_BACKWARD"))
    with pytest.raises(Exception, match="inconsistent stack depth"):
        _insert(code, back, [("LOAD_CONST", 0)])


def test_replace_kwargs_reach_the_new_code_object():
    code = loops.__code__
    same = [(o[0], o[1], o[2], i) for i, o in enumerate(bc.instructions(code))]
    table = bc.exception_table(code)
    renamed = bc.assemble_code(code, same, table, {"co_name": "renamed"})
    assert renamed.co_name == "renamed" and renamed.co_code == code.co_code
    # Lines are stored relative to co_firstlineno: moving it re-encodes the table, positions stay.
    moved = bc.assemble_code(code, same, table, {"co_firstlineno": code.co_firstlineno - 40})
    assert moved.co_firstlineno == code.co_firstlineno - 40
    assert moved.co_linetable != code.co_linetable
    assert list(moved.co_positions()) == list(code.co_positions())
    assert _rebuild(loops, moved)(20) == loops(20)
    with pytest.raises(Exception, match="co_code is computed"):
        bc.assemble_code(code, same, table, {"co_code": b""})


def test_code_without_line_table_decodes_without_locations():
    code = loops.__code__.replace(co_linetable=b"")
    assert all(o[4] == -1 for o in bc.instructions(code))
    # CPython yields no positions past the table's end; the rebuilt table states "no location" instead.
    rebuilt = bc.roundtrip(code)
    assert set(rebuilt.co_positions()) == {(None, None, None, None)}
    assert _rebuild(loops, rebuilt)(12) == loops(12)


def test_layout_the_interpreter_relies_on_is_enforced():
    ours = bc.instructions(generator.__code__)
    after_yield = next(i for i, o in enumerate(ours) if o[0] == "YIELD_VALUE") + 1
    with pytest.raises(Exception, match="YIELD_VALUE must be followed directly by RESUME"):
        _insert(generator.__code__, after_yield, [("NOP", 0)])
    if sys.version_info >= (3, 12):
        ours = bc.instructions(loops.__code__)
        end_for = next(i for i, o in enumerate(ours) if o[0] == "END_FOR")
        with pytest.raises(Exception, match="FOR_ITER must jump to END_FOR"):
            _insert(loops.__code__, end_for, [("NOP", 0)])
    else:
        ours = bc.instructions(loops.__code__)
        call = next(i for i, o in enumerate(ours) if o[0] == "CALL")
        with pytest.raises(Exception, match="PRECALL must be followed directly by CALL"):
            _insert(loops.__code__, call, [("NOP", 0)])


def test_opcode_table_comes_from_the_running_python():
    import opcode
    for name in ("LOAD_FAST", "JUMP_BACKWARD", "FOR_ITER", "RETURN_VALUE", "NOP"):
        info = bc.opcode_info(name)
        assert info["opcode"] == opcode.opmap[name]
    assert bc.opcode_info("JUMP_BACKWARD")["is_backward_jump"]
    assert not bc.opcode_info("JUMP_FORWARD")["is_backward_jump"]
    assert bc.opcode_info("RETURN_VALUE")["is_terminator"]
    assert not bc.opcode_info("NOP")["has_arg"]
    # PRECALL exists only in 3.11: absent opcodes are reported as absent, not guessed.
    assert (bc.opcode_info("PRECALL") is None) == (sys.version_info >= (3, 12))
    load_global = bc.opcode_info("LOAD_GLOBAL")
    entries = opcode._inline_cache_entries
    expected = entries["LOAD_GLOBAL"] if isinstance(entries, dict) else entries[opcode.opmap["LOAD_GLOBAL"]]
    assert load_global["caches"] == expected
