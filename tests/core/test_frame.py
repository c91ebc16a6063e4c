"""The PEP 523 frame hook (csrc/frame) driven through kiln._core.frame; runs without torch.

A callback plays the compiler. Most tests hand back the intercepted code with its "orig" string
constant replaced by "kiln", so a result saying "kiln" proves the transformed code ran in the
shadow frame, and everything else in the result proves the arguments arrived intact.
"""
import asyncio
import difflib
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import traceback
import tracemalloc

import pytest

from kiln import _core

frame = _core.frame


def with_marker(code, old="orig", new="kiln", **replace):
    consts = tuple(new if isinstance(c, str) and c == old else c for c in code.co_consts)
    return code.replace(co_consts=consts, **replace)


class Recorder:
    """A compiler callback that records what it was offered and transforms the chosen codes."""

    def __init__(self, only=None, transform=with_marker, guard=None, decision=None):
        self.only = None if only is None else {getattr(f, "__code__", f) for f in only}
        self.transform, self.guard, self.decision = transform, guard, decision
        self.seen, self.infos, self.threads = [], [], []

    def __call__(self, info):
        self.seen.append(info["code"])
        self.infos.append(info)
        self.threads.append(threading.get_ident())
        if self.only is not None and info["code"] not in self.only:
            return None
        if self.decision is not None:
            return self.decision
        return (self.transform(info["code"]), self.guard)

    def names(self):
        return [c.co_name for c in self.seen]


def run(callback, fn, *args, **kwargs):
    return frame.run_with_compiler(callback, fn, *args, **kwargs)


@pytest.fixture(autouse=True)
def clean_hook():
    frame.reset()
    yield
    assert frame.set_compiler(None) is None, "a test left a compiler set"
    assert not frame.hook_installed()
    frame.reset()


# --- functions under test (module level: stable code objects, no accidental closures) ---------

def signature(a, b=2, *args, c=3, **kw):
    return ("orig", a, b, args, c, kw)


def keyword_only(*, x, y=10):
    return ("orig", x, y)


def make_counter(start):
    count = start

    def bump(step):
        nonlocal count
        count += step
        return ("orig", count)

    return bump


def argument_cell(a, b):
    def read():
        return a + b

    a = a * 10  # the cell, not a copy: read() sees this
    return ("orig", read())


class Base:
    def describe(self, x):
        return ("base", x)


class Derived(Base):
    def __init__(self, scale):
        self.scale = scale

    def describe(self, x):
        return ("orig", super().describe(x * self.scale))

    @staticmethod
    def static(x):
        return ("orig", x)

    @classmethod
    def klass(cls, x):
        return ("orig", cls.__name__, x)


def raiser(x):
    y = x + 1
    raise ValueError("orig", y)


def calls_raiser(x):
    return raiser(x)


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def identity(x):
    return x


RESULT = object()


def returns_global(x):
    return RESULT


def typed(x):
    return ("orig", x)


def helper_for_callback():
    return 1


def gen(n):
    for i in range(n):
        yield ("orig", i)


def uses_gen(n):
    return list(gen(n)) + [sum(i for _, i in gen(n))]


async def coro(x):
    await asyncio.sleep(0)
    return ("orig", x)


async def agen(n):
    for i in range(n):
        await asyncio.sleep(0)
        yield i


async def async_main(n):
    values = [v async for v in agen(n)]
    return await coro(sum(values))


def run_async(n):
    return asyncio.run(async_main(n))


def has_class_body():
    class Inner:
        value = "orig"

    return Inner.value


def keeps_frame(a):
    b = a * 2
    return sys._getframe(), "orig"


def outer_of_skipped(x):
    return typed(x)


# --- running transformed code -----------------------------------------------------------------

@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((1,), {}, (1, 2, (), 3, {})),
        ((1, 5), {}, (1, 5, (), 3, {})),
        ((1, 5, 6, 7), {}, (1, 5, (6, 7), 3, {})),
        ((1,), {"c": 9}, (1, 2, (), 9, {})),
        ((1,), {"b": 4, "z": 8, "w": 0}, (1, 4, (), 3, {"z": 8, "w": 0})),
        ((1, 2, 3), {"c": 4, "d": 5}, (1, 2, (3,), 4, {"d": 5})),
    ],
)
def test_transformed_code_runs_with_the_same_arguments(args, kwargs, expected):
    rec = Recorder(only=[signature])
    assert run(rec, signature, *args, **kwargs) == ("kiln",) + expected  # miss: compiled, then run
    assert run(rec, signature, *args, **kwargs) == ("kiln",) + expected  # hit
    assert signature(*args, **kwargs) == ("orig",) + expected            # no compiler: original
    assert frame.entries(signature) == 1
    assert frame.counters()["hits"] == 1 and frame.counters()["misses"] == 1
    info = rec.infos[0]
    assert info["function"] is signature and info["globals"] is globals() and info["entries"] == 0


def test_keyword_only_arguments():
    rec = Recorder(only=[keyword_only])
    assert run(rec, keyword_only, x=1) == ("kiln", 1, 10)
    assert run(rec, keyword_only, y=2, x=1) == ("kiln", 1, 2)
    assert rec.infos[0]["locals"] == {"x": 1, "y": 10}


def test_frame_info_locals_are_the_bound_arguments():
    rec = Recorder(only=[signature])
    run(rec, signature, 1, 5, 6, c=7, z=9)
    assert rec.infos[0]["locals"] == {"a": 1, "b": 5, "args": (6,), "c": 7, "kw": {"z": 9}}


def test_closures_share_cells_with_the_enclosing_function():
    bump = make_counter(100)
    rec = Recorder(only=[bump])
    assert run(rec, bump, 1) == ("kiln", 101)
    assert run(rec, bump, 5) == ("kiln", 106)  # the shadow frame writes through the same cell
    assert bump(1) == ("orig", 107)
    assert rec.infos[0]["locals"]["count"] == 100  # free variables are read from the closure
    other = make_counter(0)  # same code, another closure: the cached entry must use its cells
    assert run(rec, other, 2) == ("kiln", 2)
    assert run(rec, bump, 0) == ("kiln", 107)


def test_argument_that_is_also_a_cell():
    rec = Recorder(only=[argument_cell])
    assert run(rec, argument_cell, 1, 2) == ("kiln", 12)
    assert run(rec, argument_cell, 3, 4) == ("kiln", 34)
    assert rec.infos[0]["locals"] == {"a": 1, "b": 2}  # raw value: MAKE_CELL has not run yet


def test_methods_static_class_and_zero_argument_super():
    obj = Derived(3)
    rec = Recorder(only=[Derived.describe, Derived.static, Derived.klass.__func__])
    for _ in range(2):
        assert run(rec, obj.describe, 2) == ("kiln", ("base", 6))
        assert run(rec, Derived.static, 4) == ("kiln", 4)
        assert run(rec, Derived.klass, 5) == ("kiln", "Derived", 5)
    assert frame.counters()["hits"] == 3


def test_exception_in_transformed_code_has_the_users_traceback():
    rec = Recorder(only=[raiser, calls_raiser])
    for _ in range(2):  # miss, then hit
        with pytest.raises(ValueError) as caught:
            run(rec, calls_raiser, 1)
        assert caught.value.args == ("kiln", 2)
        entries = traceback.extract_tb(caught.value.__traceback__)
        assert [e.name for e in entries[-2:]] == ["calls_raiser", "raiser"]
        assert entries[-1].lineno == raiser.__code__.co_firstlineno + 2
        assert entries[-1].line == 'raise ValueError("orig", y)'
        tb = caught.value.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        # The dead shadow frame lives on in its frame object, linked to its caller.
        assert tb.tb_frame.f_locals == {"x": 1, "y": 2}
        assert tb.tb_frame.f_back.f_code.co_name == "calls_raiser"


def test_frame_object_outlives_the_shadow_frame():
    rec = Recorder(only=[keeps_frame])
    for _ in range(2):
        fr, marker = run(rec, keeps_frame, 21)
        assert marker == "kiln"
        assert fr.f_locals == {"a": 21, "b": 42}
        assert fr.f_code.co_name == "keeps_frame" and "kiln" in fr.f_code.co_consts
        assert fr.f_back.f_code.co_name == "run"  # the helper that called run_with_compiler
        assert fr.f_lineno == keeps_frame.__code__.co_firstlineno + 2


def test_exception_in_the_callback_propagates():
    def failing(info):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        run(failing, typed, 1)
    assert frame.entries(typed) == 0
    assert run(Recorder(only=[typed]), typed, 2) == ("kiln", 2)


def test_bad_callback_results_raise_type_error():
    for bad in [42, "other", (typed.__code__,), ("not code", None), (typed.__code__, 3)]:
        with pytest.raises(TypeError):
            run(Recorder(decision=bad), typed, 1)
    assert frame.entries(typed) == 0


def test_transformed_code_must_bind_the_same_arguments():
    rec = Recorder(only=[typed], transform=lambda code: signature.__code__)
    with pytest.raises(TypeError, match="same arguments"):
        run(rec, typed, 1)
    assert frame.entries(typed) == 0
    assert typed(1) == ("orig", 1)


# --- cache behaviour --------------------------------------------------------------------------

def test_guards_select_between_entries_in_mru_order():
    calls = []

    def guard_for(kind):
        def guard(info):
            calls.append(kind.__name__)
            return type(info["locals"]["x"]) is kind
        return guard

    def compiler(info):
        kind = type(info["locals"]["x"])
        code = with_marker(info["code"], new="kiln-" + kind.__name__, co_qualname="typed_" + kind.__name__)
        return (code, guard_for(kind))

    assert run(compiler, typed, 1) == ("kiln-int", 1)
    assert run(compiler, typed, "s") == ("kiln-str", "s")
    assert frame.entry_labels(typed) == ["typed_str", "typed_int"]
    calls.clear()
    assert run(compiler, typed, 2) == ("kiln-int", 2)  # str's guard fails, int's passes
    assert calls == ["str", "int"]
    assert frame.entry_labels(typed) == ["typed_int", "typed_str"]  # moved to the front
    calls.clear()
    assert run(compiler, typed, 3) == ("kiln-int", 3)
    assert calls == ["int"]
    assert frame.counters() == {"hits": 2, "misses": 2, "default_runs": 0}
    assert run(compiler, typed, 1.5) == ("kiln-float", 1.5)
    assert frame.entries(typed) == 3


def test_guard_sees_entry_count_and_a_failing_guard_raises_nothing(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def bad_guard(info):
        raise RuntimeError("guard bug")

    rec = Recorder(only=[typed], guard=bad_guard)
    assert run(rec, typed, 1) == ("kiln", 1)  # added, runs without a guard check
    assert run(rec, typed, 1) == ("kiln", 1)  # guard raises -> miss -> another entry
    assert frame.entries(typed) == 2
    assert len(unraisable) == 1 and isinstance(unraisable[0].exc_value, RuntimeError)
    assert rec.infos[1]["entries"] == 1


def test_skip_marks_the_code_for_good():
    rec = Recorder(decision="skip")
    for i in range(3):
        assert run(rec, typed, i) == ("orig", i)
    assert rec.names() == ["typed"]
    assert frame.is_skipped(typed)
    # Calls made by a skipped function are still offered.
    rec2 = Recorder(only=[typed])
    assert run(rec2, outer_of_skipped, 4) == ("orig", 4)
    assert rec2.names() == ["outer_of_skipped"]
    frame.reset()
    assert not frame.is_skipped(typed)
    assert run(rec2, typed, 5) == ("kiln", 5)


def test_suspend_runs_the_original_and_intercepts_nothing_it_calls():
    # What a torch.compiler.disable wrapper gets from kiln's compiler: its whole call tree runs uncompiled.
    rec = Recorder(decision="suspend", only=[outer_of_skipped])
    for i in range(2):
        assert run(rec, outer_of_skipped, i) == ("orig", i)
    assert rec.names() == ["outer_of_skipped"] * 2  # asked again each call; typed, called inside, never offered
    assert not frame.is_skipped(outer_of_skipped)
    assert run(Recorder(only=[typed]), outer_of_skipped, 3) == ("kiln", 3)  # the suspension ended with the call


def test_none_runs_the_original_and_asks_again():
    rec = Recorder(decision=None, only=[])
    for i in range(3):
        assert run(rec, typed, i) == ("orig", i)
    assert rec.names() == ["typed"] * 3
    assert frame.entries(typed) == 0
    assert frame.counters() == {"hits": 0, "misses": 3, "default_runs": 3}


def test_frames_run_by_the_compiler_and_guards_are_not_intercepted():
    def compiler(info):
        helper_for_callback()
        return (info["code"], lambda info: helper_for_callback() == 1) if info["code"] is typed.__code__ else None

    seen = []

    def recording(info):
        seen.append(info["code"].co_name)
        return compiler(info)

    for i in range(3):
        run(recording, typed, i)
    assert seen == ["typed"]
    assert frame.counters()["hits"] == 2


def test_generators_coroutines_and_async_never_reach_the_callback():
    rec = Recorder()  # intercepts everything it is offered, returning the marker-swapped code
    expected = [("orig", 0), ("orig", 1), ("orig", 2), 3]
    assert run(rec, uses_gen, 3) == [("orig", 0), ("orig", 1), ("orig", 2), 3]
    assert uses_gen(3) == expected
    assert run(rec, run_async, 4) == ("orig", 6)
    never = {gen.__code__, coro.__code__, agen.__code__, async_main.__code__}
    assert not never & set(rec.seen)
    assert "uses_gen" in rec.names() and "run_async" in rec.names()
    assert run(rec, run_async, 4) == ("orig", 6)  # again, on cached entries of asyncio internals
    assert frame.counters()["hits"] > 0


def test_class_bodies_are_not_offered():
    rec = Recorder()
    assert run(rec, has_class_body) == "orig"  # "orig" lives in the class body, which runs as is
    assert "Inner" not in rec.names()


def test_recursion():
    rec = Recorder(transform=lambda code: code)
    assert run(rec, fib, 18) == 2584
    assert frame.counters()["misses"] == 1
    assert frame.counters()["hits"] > 8000


def test_deep_recursion_across_data_stack_chunks():
    # ~100 words of locals per frame, twice per level (original + shadow): well past one chunk.
    source = "def deep(n):\n" + "".join(f"    v{i} = n\n" for i in range(100))
    source += "    return 0 if n == 0 else deep(n - 1) + v99\n"
    namespace = {}
    exec(source, namespace)
    deep = namespace["deep"]
    rec = Recorder(transform=lambda code: code)
    for _ in range(3):
        assert run(rec, deep, 150) == 150 * 151 // 2


def test_hook_is_installed_only_while_a_compiler_is_set():
    assert not frame.hook_installed()
    assert frame.set_compiler(identity) is None
    assert frame.hook_installed()
    assert frame.set_compiler(typed) is identity
    assert frame.set_compiler(None) is typed
    assert not frame.hook_installed()


def test_settrace_and_setprofile_disable_interception():
    rec = Recorder(only=[typed])

    def tracer(*args):
        return None

    for install in (sys.settrace, sys.setprofile):
        install(tracer)
        try:
            assert run(rec, typed, 1) == ("orig", 1)
        finally:
            install(None)
    assert rec.seen == []
    assert run(rec, typed, 1) == ("kiln", 1)


# --- references and memory --------------------------------------------------------------------

def test_no_reference_or_object_leaks_over_1000_calls():
    arg = object()
    counter = make_counter(0)
    keep = lambda info: (info["code"], None)  # noqa: E731
    keep_guarded = lambda info: (info["code"], lambda info: info["locals"]["x"] is arg)  # noqa: E731
    cases = [
        (keep, identity, arg),                # hits
        (keep_guarded, identity, arg),        # hits through a Python guard reading the argument
        (keep, returns_global, arg),          # hits, the result is a global
        (lambda info: None, identity, arg),   # misses that run the original
        (keep, counter, arg),                 # a closure: a fresh shadow function per call
    ]
    for callback, fn, argument in cases:
        frame.reset()
        run(callback, fn, 0) if fn is counter else run(callback, fn, argument)
        gc.collect()
        before = (sys.getrefcount(arg), sys.getrefcount(RESULT), len(gc.get_objects()))
        for _ in range(1000):
            run(callback, fn, 1) if fn is counter else run(callback, fn, argument)
        gc.collect()
        after = (sys.getrefcount(arg), sys.getrefcount(RESULT), len(gc.get_objects()))
        assert after[:2] == before[:2], fn
        assert after[2] - before[2] < 50, fn


def test_no_memory_growth_on_hits_and_exceptions():
    rec = Recorder(only=[raiser, identity])

    def loop():
        for i in range(1000):
            identity(i)
            try:
                raiser(i)
            except ValueError:
                pass

    run(rec, loop)
    tracemalloc.start()
    try:
        run(rec, loop)
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        run(rec, loop)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 16 * 1024
    assert frame.counters()["hits"] >= 3000


# --- threads ----------------------------------------------------------------------------------

def thread_a_function(x):
    return ("orig", "a", x)


def thread_b_function(x):
    return ("orig", "b", x)


def test_two_threads_with_their_own_compilers():
    recorders = {"a": Recorder(transform=lambda c: with_marker(c, new="kiln-a")),
                 "b": Recorder(transform=lambda c: with_marker(c, new="kiln-b"))}
    functions = {"a": thread_a_function, "b": thread_b_function}
    barrier = threading.Barrier(2)
    results, idents = {}, {}

    def body(name):
        idents[name] = threading.get_ident()
        barrier.wait()
        out = []
        for i in range(300):
            out.append(run(recorders[name], functions[name], i))
        results[name] = out

    threads = [threading.Thread(target=body, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in "ab":
        assert results[name] == [("kiln-" + name, name, i) for i in range(300)]
        assert set(recorders[name].threads) == {idents[name]}
        assert recorders[name].names() == [functions[name].__name__]


def test_thread_without_compiler_is_never_intercepted():
    rec = Recorder(only=[thread_a_function])
    stop = threading.Event()
    plain_results = []

    def plain():
        while not stop.is_set():
            plain_results.append(thread_a_function(1))
            thread_b_function(2)

    t = threading.Thread(target=plain)
    t.start()
    try:
        for i in range(300):
            assert run(rec, thread_a_function, i) == ("kiln", "a", i)
            if i % 50 == 0:
                threading.Event().wait(0.001)  # let the other thread run while the hook is in
    finally:
        stop.set()
        t.join()
    assert plain_results and set(plain_results) == {("orig", "a", 1)}
    assert set(rec.threads) == {threading.get_ident()}
    assert "thread_b_function" not in rec.names()


# --- real code --------------------------------------------------------------------------------

def real_workload():
    data = {"name": "kiln", "values": [1, 2.5, None, True, {"nested": ["x", "y", {"z": [1, [2, [3]]]}]}],
            "text": "ünïcödé \n\t\"quoted\"", "empty": {}, "list": list(range(50))}
    encoded = json.dumps(data, indent=2, sort_keys=True)
    decoded = json.loads(encoded)
    wrapped = textwrap.fill("The frame hook intercepts every frame of this workload " * 20, width=37)
    dedented = textwrap.dedent("    a\n      b\n    c\n")
    a = [f"line {i}\n" for i in range(60)]
    b = [f"line {i if i % 7 else -i}\n" for i in range(60)]
    diff = list(difflib.unified_diff(a, b, "a", "b"))
    ratio = difflib.SequenceMatcher(None, "".join(a), "".join(b)).ratio()
    return encoded, decoded, wrapped, dedented, diff, ratio


def test_real_code_with_every_frame_intercepted():
    expected = real_workload()
    rec = Recorder(transform=lambda code: code)
    assert run(rec, real_workload) == expected  # first run: compiles everything it meets
    assert run(rec, real_workload) == expected  # second run: served from entries
    assert len(set(rec.seen)) > 20
    assert frame.counters()["hits"] > 100


def test_interpreter_shutdown_with_live_entries_and_compiler():
    script = textwrap.dedent(
        """
        import sys, threading
        sys.path.insert(0, %r)
        from kiln import _core
        F = _core.frame

        def f(x):
            return x + 1

        def g(x):
            return [f(i) for i in range(x)]

        F.set_compiler(lambda info: (info["code"], lambda i: True))
        assert g(5) == [1, 2, 3, 4, 5] and g(5) == [1, 2, 3, 4, 5]
        assert F.entries(f) == 1 and F.hook_installed()
        t = threading.Thread(target=lambda: F.set_compiler(lambda info: None) and None, daemon=True)
        t.start(); t.join()
        print("done")
        """
    ) % (os.path.dirname(os.path.dirname(_core.__file__)),)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "Error" not in proc.stderr and "Exception" not in proc.stderr
