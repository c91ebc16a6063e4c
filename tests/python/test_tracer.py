"""The tracer on straight-line model code: what it captures, what it guards, where it falls back.

Every test compares with eager on fresh random inputs and asserts how many frames were compiled,
hit, recompiled or fell back.
"""
import functools
import gc
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.testing import assert_same_as_eager, random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def stats():
    return kiln.stats()


SCALE = 2.0


def test_globals_constants_and_keyword_arguments():
    def f(x, y, *, alpha=0.5):
        return torch.add(x, y, alpha=alpha) * SCALE - x.mean(dim=-1, keepdim=True)

    x, y = torch.randn(4, 5), torch.randn(4, 5)
    out = kiln.compile(f)(x, y, alpha=0.25)
    torch.testing.assert_close(out, f(x, y, alpha=0.25))
    assert stats()["frames_compiled"] == 1 and stats()["fallbacks"] == 0


def test_global_constant_change_recompiles():
    global SCALE
    def f(x):
        return x * SCALE

    cf = kiln.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(cf(x), x * 2.0)
    old = SCALE
    try:
        SCALE = 3.0
        torch.testing.assert_close(cf(x), x * 3.0)
    finally:
        SCALE = old
    assert stats()["recompiles"] == 1


def test_user_function_inlined_with_defaults_varargs_and_closure():
    bias = torch.randn(6)

    def helper(x, *rest, scale=1.0, **kw):
        out = x * scale
        for r in rest:
            out = out + r
        return out + kw.get("shift", 0.0) if "shift" in kw else out

    def f(x, y):
        return helper(x, y, y, scale=3.0, shift=1.5) + bias

    x, y = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(kiln.compile(f)(x, y), f(x, y))
    assert stats()["frames_compiled"] == 1 and stats()["fallbacks"] == 0


def test_closure_cell_change_is_guarded():
    factor = [2.0]

    def make():
        k = factor[0]

        def f(x):
            return x * k
        return f

    f2 = make()
    factor[0] = 5.0
    f5 = make()
    x = torch.randn(3)
    torch.testing.assert_close(kiln.compile(f2)(x), x * 2.0)
    torch.testing.assert_close(kiln.compile(f5)(x), x * 5.0)


def test_branches_and_loops_on_trace_time_values():
    class Net(nn.Module):
        def __init__(self, n, use_norm):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(n)])
            self.use_norm = use_norm
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i % 2 == 0:
                    x = F.gelu(x)
            if self.use_norm:
                x = self.norm(x)
            return x, {"shape": tuple(x.shape), "sum": x.sum()}

    model = Net(3, True)
    x = torch.randn(2, 8)
    out, info = kiln.compile(model)(x)
    ref, ref_info = model(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(info["sum"], ref_info["sum"])
    assert info["shape"] == ref_info["shape"]
    assert stats()["frames_compiled"] == 1 and stats()["fallbacks"] == 0


def test_module_flag_change_recompiles():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.double = False

        def forward(self, x):
            return x * 2 if self.double else x + 1

    m = Net()
    cm = kiln.compile(m)
    x = torch.randn(3)
    torch.testing.assert_close(cm(x), x + 1)
    m.double = True
    torch.testing.assert_close(cm(x), x * 2)
    assert stats()["recompiles"] == 1


def test_eval_train_switch_recompiles_builtin_module():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    cm = kiln.compile(m)
    x = torch.randn(8, 4)
    m.eval()
    torch.testing.assert_close(cm(x), m(x))
    m.train()
    ref_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref_model.load_state_dict(m.state_dict())
    torch.testing.assert_close(cm(x), ref_model(x))
    # Training-mode BatchNorm updated the running statistics of the shared module, as eager does.
    torch.testing.assert_close(m[1].running_mean, ref_model[1].running_mean)
    assert stats()["recompiles"] >= 1


def test_same_tensor_twice_is_guarded():
    def f(a, b):
        return a * 2 + b

    cf = kiln.compile(f)
    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(cf(x, x), x * 3)
    torch.testing.assert_close(cf(x, y), x * 2 + y)
    assert stats()["recompiles"] == 1


def test_views_and_inplace_on_intermediates():
    def f(x):
        y = x.transpose(0, 1).reshape(-1)
        z = y.clone()
        z.mul_(2)
        z[1:3] += 1
        return z.view(3, 4), y[::2]

    x = torch.randn(4, 3)
    assert_same_as_eager(f, x)


def test_input_mutation_is_visible_like_eager():
    def f(x):
        x.add_(1)
        return x * 2

    a = torch.randn(4)
    b = a.clone()
    out = kiln.compile(f)(a)
    ref = f(b)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a, b)


def test_tensor_attributes_are_guarded_constants():
    def f(x):
        n, d = x.shape
        if x.dtype == torch.float64:
            return x.sum() * n
        return x.reshape(d, n) + x.size(0) + x.dim()

    cf = kiln.compile(f)
    x = torch.randn(3, 4)
    torch.testing.assert_close(cf(x), f(x))
    xd = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(cf(xd), f(xd))
    assert stats()["recompiles"] == 1


def test_returning_input_keeps_identity_and_constants():
    def f(x, k):
        return x, k, None, (x + k,)

    x = torch.randn(2)
    out = kiln.compile(f)(x, 3)
    assert out[0] is x and out[1] == 3 and out[2] is None
    torch.testing.assert_close(out[3][0], x + 3)


def test_data_dependent_branch_falls_back_with_a_reason():
    def f(x):
        if x.sum() > 0:
            return x + 1
        return x - 1

    cf = kiln.compile(f)
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(cf(x), f(x))
    # A graph break at the branch (graph + resume function), not a whole-frame fallback.
    assert stats()["graph_breaks"] == 1 and stats()["fallbacks"] == 0, stats()
    report = kiln.explain(f)(torch.randn(5))
    assert report.graph_break_count == 1 and "data-dependent" in report.break_reasons[0]


def test_fullgraph_raises_graph_break_error_naming_the_line():
    def f(x):
        print("side effect")
        return x + 1

    with pytest.raises(kiln.errors.GraphBreakError, match=r"test_tracer.py:\d+"):
        kiln.compile(f, fullgraph=True)(torch.randn(2))


def test_two_compiles_of_one_function_keep_separate_entries():
    calls = []

    def counting_backend(graph, example_inputs):
        def run(inputs):
            calls.append(1)
            return kiln._C.run_graph(graph, "eager", inputs)
        return run

    def f(x):
        return torch.sin(x) + 1

    x = torch.randn(3)
    a = kiln.compile(f, backend="eager")
    b = kiln.compile(f, backend=counting_backend)
    torch.testing.assert_close(a(x), f(x))
    torch.testing.assert_close(b(x), f(x))
    torch.testing.assert_close(b(x), f(x))
    assert len(calls) == 2
    assert stats()["frames_compiled"] == 2 and stats()["recompiles"] == 0


def test_disable_inside_compiled_code():
    @kiln.disable
    def untouched(x):
        return x * 3

    def f(x):
        return untouched(x) + 1

    x = torch.randn(3)
    torch.testing.assert_close(kiln.compile(f)(x), x * 3 + 1)


def test_partial_and_lambda():
    scale = functools.partial(torch.mul, other=2.0)
    square = lambda t: t * t  # noqa: E731

    def f(x):
        return square(x) + scale(x)

    x = torch.randn(4)
    torch.testing.assert_close(kiln.compile(f)(x), f(x))


def test_list_from_the_frame_is_returned_as_itself_after_a_break():
    import types
    holder = types.SimpleNamespace(sink=None)

    class Recorder:
        def __init__(self, target):
            self._target = target

        def enter(self):
            log = []
            self._target.sink = log.append  # an attribute store: a graph break
            return log

    def f(x):
        log = Recorder(holder).enter()
        holder.sink("seen")  # appends, eagerly, to the list `log` names
        return log, x + 1

    compiled = kiln.compile(f)
    for _ in range(3):
        log, y = compiled(torch.ones(2))
        assert log == ["seen"]
        torch.testing.assert_close(y, torch.full((2,), 2.0))


def test_returning_an_argument_list_returns_that_list():
    def f(items, x):
        return items, x * 2

    items = [1, 2]
    out, _ = kiln.compile(f)(items, torch.randn(2))
    assert out is items


def test_zero_argument_super_in_a_frame_with_a_graph_break(fresh_kiln):
    # A resume function's first argument is not the frame's `self`, so a frame that uses super() must not be
    # split at a break (HuggingFace's config __getattribute__ did this): it runs eagerly instead, correctly.
    class Base(torch.nn.Module):
        def scale(self):
            return 2.0

    class Child(Base):
        def forward(self, x):
            y = x + 1
            print("break", end="")
            return y * super().scale()

    m = Child()
    x = torch.randn(5)
    torch.testing.assert_close(kiln.compile(m)(x), m(x))
    torch.testing.assert_close(kiln.compile(m)(x), m(x))


def test_exception_raised_after_a_break_does_not_outlive_its_except_block():
    # CPython's testExceptionCleanupState: the resume function that raises got the exception as an argument,
    # so its frame (kept by the traceback) held the exception: a cycle eager never makes.
    import gc
    import weakref

    class Payload:
        pass

    class Boom(Exception):
        def __init__(self, payload):
            self.payload = payload

    def f(x, payload):
        y = x + 1
        raise Boom(payload)  # constructing a user exception class is a graph break

    compiled = kiln.compile(f)
    gc.disable()  # a cycle would only be freed by the collector; eager frees the payload at once
    try:
        for _ in range(2):
            payload = Payload()
            alive = weakref.ref(payload)
            try:
                compiled(torch.ones(2), payload)
            except Boom as e:
                assert e.payload is payload
            del payload
            assert alive() is None
    finally:
        gc.enable()
    # Boom(payload) breaks, the resume function breaks at the raise; Boom.__init__, called from the break, does
    # no tensor work and gets one entry without guards that runs it eagerly (a cache hit on the second call).
    assert (stats()["graph_breaks"], stats()["fallbacks"], stats()["cache_hits"]) == (2, 0, 3), stats()


def test_stateful_builtin_results_are_new_on_every_call():
    # iter() of a constant used to be folded into one iterator object that every call returned (CPython's
    # conjoin doctest printed nothing); set()/dict() results were likewise shared between calls.
    def f(x):
        return iter((0, 1)), set((1, 2)), x + 1

    compiled = kiln.compile(f)
    for _ in range(3):
        it, s, y = compiled(torch.ones(2))
        assert list(it) == [0, 1]
        assert s == {1, 2}
        s.add(3)  # must not leak into the next call's set
        torch.testing.assert_close(y, torch.full((2,), 2.0))
    # iter() and set() are traced, and made anew on every return: one graph, hit on the later calls.
    assert (stats()["graph_breaks"], stats()["fallbacks"], stats()["cache_hits"]) == (0, 0, 2), stats()


def test_builtins_of_objects_guarded_by_type_are_not_folded():
    # An exception (or any plain object) is guarded by its type only: str()/len() of it folded at trace time
    # replayed the first call's answer for every later instance (CPython's coroutine doctests).
    class Bag:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    def f(x, err, bag):
        return str(err), len(bag), x + 1

    compiled = kiln.compile(f)
    for i in range(3):
        message, length, y = compiled(torch.ones(2), ValueError(f"call {i}"), Bag(i))
        assert (message, length) == (f"call {i}", i)
        torch.testing.assert_close(y, torch.full((2,), 2.0))
    # str(err) runs eagerly at each call instead of replaying the first call's answer; len(bag) traces Bag.__len__,
    # whose read of bag.n is guarded (a new n recompiles the resume function instead of replaying the first answer).
    assert (stats()["graph_breaks"], stats()["fallbacks"], stats()["recompiles"]) == (1, 0, 2), stats()


def test_hasattr_on_objects_guarded_by_type_is_guarded():
    # Two instances of one class may differ in their attributes: hasattr()/getattr(default) answers are guarded.
    import types

    def f(x, config):
        if hasattr(config, "scale"):
            x = x * config.scale
        return x + getattr(config, "shift", 0.0)

    compiled = kiln.compile(f)
    x = torch.ones(2)
    for config in [types.SimpleNamespace(), types.SimpleNamespace(scale=3.0), types.SimpleNamespace(shift=1.0),
                   types.SimpleNamespace(scale=2.0, shift=5.0), types.SimpleNamespace()]:
        torch.testing.assert_close(compiled(x, config), f(x, config))
    assert stats()["fallbacks"] == 0, stats()


SENTINEL = []


def test_is_between_a_local_list_and_a_global_list():
    # copy.deepcopy's `y = memo.get(d, _nil); if y is not _nil: return y`: the local may be the global list
    # itself, so `is` between two containers read through different paths is not decided at trace time.
    def f(x, items):
        if items is SENTINEL:
            return x + 1
        return x - 1

    compiled = kiln.compile(f)
    x = torch.ones(2)
    for items in [SENTINEL, [], SENTINEL, []]:
        torch.testing.assert_close(compiled(x, items), f(x, items))


# ---- Python constructs of real models (HuggingFace, timm): each traced without a break, guarded ----------


def graphs_and_breaks(fn, *args):
    e = kiln.explain(fn)(*args)
    kiln.reset()  # explain's entries and counts stay out of the test's own
    return e.graph_count, e.graph_break_count


def test_import_inside_a_function_is_traced():
    def f(x):
        import math
        import os.path
        from torch.nn import functional as nnf
        return nnf.relu(x) * math.pi + len(os.path.sep)

    x = torch.randn(4)
    assert graphs_and_breaks(f, x) == (1, 0)
    assert_same_as_eager(f, x)


def test_import_of_a_module_not_imported_yet_runs_eagerly(tmp_path, monkeypatch):
    # Importing runs the module's code: it must happen, once, as in eager, never at trace time.
    (tmp_path / "kiln_probe_fresh_module.py").write_text("LOADS = []\nLOADS.append(1)\nFACTOR = 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "kiln_probe_fresh_module", raising=False)

    def f(x):
        import kiln_probe_fresh_module as probe
        return x * probe.FACTOR

    x = torch.randn(3)
    compiled = kiln.compile(f)
    torch.testing.assert_close(compiled(x), x * 3.0)
    import kiln_probe_fresh_module as probe
    assert probe.LOADS == [1]
    torch.testing.assert_close(compiled(x), x * 3.0)
    assert probe.LOADS == [1]


def test_str_methods_of_a_guarded_string_fold_and_recompile_on_change():
    def f(x, mode):
        if mode.startswith("paged|") and mode.removeprefix("paged|").upper() == "SDPA":
            return x * 2
        return x + 1

    compiled = kiln.compile(f)
    x = torch.randn(3)
    for mode in ["paged|sdpa", "eager", "paged|sdpa", "paged|flash"]:
        torch.testing.assert_close(compiled(x, mode), f(x, mode))
    s = stats()
    assert (s["frames_compiled"], s["cache_hits"], s["graph_breaks"], s["fallbacks"]) == (3, 1, 0, 0), s


def test_type_of_traced_values():
    class Layer(nn.Module):
        def forward(self, x):
            assert type(x) is torch.Tensor
            if type(self).forward is Layer.forward and type((x, 1)) is tuple and type({}) is dict:
                return x * 2
            return x

    m = Layer()
    x = torch.randn(3)
    assert graphs_and_breaks(m, x) == (1, 0)
    assert_same_as_eager(m, x)


class _Registry(dict):
    def get(self, key):
        return super().get(key) or {}


_REGISTRY = _Registry(alpha={"scale": 2.0})


def test_zero_and_two_argument_super_are_traced():
    class Base(nn.Module):
        def scale(self):
            return 2.0

    class Child(Base):
        def scale(self):
            return super().scale() + super(Child, self).scale()

        def forward(self, x):
            return x * self.scale() * _REGISTRY.get("alpha").get("scale", 1.0) + len(_REGISTRY.get("beta"))

    m = Child()
    x = torch.randn(3)
    assert graphs_and_breaks(m, x) == (1, 0)
    compiled = kiln.compile(m)
    torch.testing.assert_close(compiled(x), m(x))
    # The registry's items are guarded: a new registration recompiles instead of replaying the old answer.
    _REGISTRY["beta"] = {"a": 1, "b": 2}
    try:
        torch.testing.assert_close(compiled(x), m(x))
    finally:
        del _REGISTRY["beta"]
    s = stats()
    assert (s["frames_compiled"], s["recompiles"], s["graph_breaks"], s["fallbacks"]) == (2, 1, 0, 0), s


def test_functools_partial_made_in_traced_code():
    def scaled(t, scale, shift=0.0):
        return t * scale + shift

    def f(x):
        double = functools.partial(scaled, scale=2.0)
        shifted = functools.partial(scaled, x, shift=1.0)
        return double(x) + shifted(3.0) + double(x, scale=5.0)

    x = torch.randn(3)
    assert graphs_and_breaks(f, x) == (1, 0)
    assert_same_as_eager(f, x)


def test_dicts_made_in_traced_code_are_mutated_in_the_trace():
    def consume(a=None, b=None, c=None):
        return a * 2 + b

    def f(x, **kwargs):
        kwargs["b"] = x + 1  # the root frame's **kwargs: a fresh dict per call
        kwargs.pop("unused", None)
        d = dict(a=x, z=1)
        d["w"] = x * 3
        del d["z"]
        d.setdefault("a", None)
        d.update({"q": 2})
        total = d.pop("q")
        copied = dict(d.items())
        out = {k: v * 2 for k, v in copied.items()}
        return consume(a=out["a"], **kwargs) + out["w"] + total

    x = torch.randn(3)
    assert graphs_and_breaks(f, x) == (1, 0)
    assert_same_as_eager(f, x, unused=1)
    assert_same_as_eager(f, x)


def test_mutating_a_dict_from_outside_the_trace_is_replayed_on_it():
    def f(x, d):
        d["seen"] = d.get("seen", 0) + 1
        return x + 1

    compiled = kiln.compile(f)
    d = {}
    for i in range(3):
        torch.testing.assert_close(compiled(torch.ones(2), d), torch.full((2,), 2.0))
        assert d == {"seen": i + 1}
    # No break; the count read is an int constant of the trace, so each new count is a new entry (as an int
    # attribute counted in forward is).
    assert stats()["graph_breaks"] == 0 and stats()["fallbacks"] == 0, stats()
    assert stats()["frames_compiled"] == 3, stats()


def test_closures_made_in_traced_code():
    def f(x):
        scale = 2.0

        def times(t):
            return t * scale

        scale = 3.0  # the closure sees the later store
        add = lambda t, k=1.0: t + k  # noqa: E731
        return sum([times(t) for t in (x, x + 1)]) + add(x) + times(x)

    x = torch.randn(3)
    assert graphs_and_breaks(f, x) == (1, 0)
    assert_same_as_eager(f, x)


def test_context_var_set_and_reset_in_one_trace():
    import contextvars
    collector = contextvars.ContextVar("kiln_test_collector", default=None)

    def f(x):
        token = collector.set([x])
        try:
            y = x * len(collector.get())
        finally:
            collector.reset(token)
        return y

    x = torch.randn(3)
    assert graphs_and_breaks(f, x) == (1, 0)
    compiled = kiln.compile(f)
    torch.testing.assert_close(compiled(x), f(x))
    assert collector.get() is None


def test_context_var_set_without_reset_keeps_eager_state():
    import contextvars
    level = contextvars.ContextVar("kiln_test_level", default=0)

    def f(x, n):
        level.set(n)
        return x + 1

    compiled = kiln.compile(f)
    for n in [1, 2]:
        torch.testing.assert_close(compiled(torch.ones(2), n), torch.full((2,), 2.0))
        assert level.get() == n
    level.set(0)


class _Interface:
    """A Mapping written in Python (HuggingFace's AttentionInterface): subscripts are traced, so guarded."""
    _global_mapping = {"double": lambda t: t * 2}

    def __init__(self):
        self._local_mapping = {}

    def __getitem__(self, key):
        if key in self._local_mapping:
            return self._local_mapping[key]
        return self._global_mapping[key]

    def __contains__(self, key):
        return key in self._local_mapping or key in self._global_mapping


_INTERFACE = _Interface()


def test_python_mapping_subscript_is_traced_and_guarded():
    def f(x):
        fn = _INTERFACE["double"] if "double" in _INTERFACE else None
        return fn(x)

    compiled = kiln.compile(f)
    x = torch.randn(3)
    assert graphs_and_breaks(f, x) == (1, 0)
    torch.testing.assert_close(compiled(x), x * 2)
    _INTERFACE._local_mapping["double"] = lambda t: t * 4  # a local override must recompile
    try:
        torch.testing.assert_close(compiled(x), x * 4)
    finally:
        _INTERFACE._local_mapping.clear()
    torch.testing.assert_close(compiled(x), x * 2)


def test_inspect_signature_of_a_method_is_folded():
    import inspect

    class Block(nn.Module):
        def chunk(self, a, b=1):
            return a * b

        def forward(self, x):
            return x * len(inspect.signature(self.chunk).parameters)

    m = Block()
    x = torch.randn(3)
    assert graphs_and_breaks(m, x) == (1, 0)
    assert_same_as_eager(m, x)


def test_two_closures_whose_cells_share_a_name_do_not_recompile():
    # Guards of two different `__class__` cells must stay two checks (they once shared one guard path).
    class Base(nn.Module):
        def scale(self):
            return 3.0

    class B(Base):
        def scale(self):
            return super().scale()

    class C(Base):
        def scale(self):
            return super().scale() * 2

    b, c = B(), C()

    def f(x):
        return x * b.scale() + x * c.scale()

    compiled = kiln.compile(f)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), f(x))
    s = stats()
    assert (s["frames_compiled"], s["cache_hits"], s["graph_breaks"]) == (1, 2, 0), s


def appends_to_its_default(x, acc=[]):  # noqa: B006 (the shared default is the point)
    acc.append(1)
    return x * len(acc)


def test_a_mutable_default_is_mutated_as_in_eager():
    # the default list is one object shared by all calls: kiln must change it as eager does, every call
    eager_default = appends_to_its_default.__defaults__[0]
    x = torch.randn(3)
    expected = [appends_to_its_default(x).clone() for _ in range(3)]
    eager_default.clear()
    compiled = kiln.compile(appends_to_its_default)
    got = [compiled(x).clone() for _ in range(3)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert eager_default == [1, 1, 1]


def _scale_method(value):
    def scale(self):
        return value

    return scale


def test_type_guards_hold_their_class_so_a_new_class_at_a_reused_address_is_not_taken_for_it():
    # Methods found on an object's type are taken as fixed behind a type guard. A class made per call dies
    # after it; CPython then often allocates the next class at the same address, which a borrowed pointer
    # would take for the traced class (this returned the first class's scale for 38 of 40 classes).
    def f(x, obj):
        return x * obj.scale()

    compiled = kiln.compile(f)
    x = torch.randn(3)
    for i in range(12):  # past the recompile limit (8): later classes run eagerly
        cls = type("PerCall", (), {"scale": _scale_method(float(i))})
        torch.testing.assert_close(compiled(x, cls()), x * float(i))
        del cls
        gc.collect()


def test_a_loop_building_a_long_attribute_chain_runs_eagerly():
    # `o = o.__dir__` in a loop makes each value one attribute step deeper. Past 256 steps the tracer stops
    # (describing, guarding and freeing such a chain recurse once per step: CPython's test_trashcan_recursion
    # overflowed the C stack with a million).
    def f(x):
        o = object()
        for _ in range(2000):
            o = o.__dir__
        return x + 1

    x = torch.randn(3)
    torch.testing.assert_close(kiln.compile(f)(x), x + 1)
    assert stats()["fallbacks"] == 1, stats()


# --- generators made or called in traced code ------------------------------------------------------------

def one_graph_like_eager(fn, *args):
    compiled = kiln.compile(fn)
    for _ in range(2):
        assert_same_as_eager(fn, *args, compiled=compiled)
    assert stats()["frames_compiled"] == 1 and stats()["graph_breaks"] == 0 and stats()["fallbacks"] == 0, stats()
    result = kiln.explain(fn)(*args)
    assert result.graph_count == 1 and result.graph_break_count == 0, result


def test_generator_expressions_are_traced():
    def attention_heads(q, k, v):
        b, t, d = q.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))  # unpacked
        total = sum(z.sum() for z in (q, k))  # consumed by a builtin
        parts = tuple(torch.relu(z) for z in (q, k, v) if z is not k)  # with a condition
        return F.scaled_dot_product_attention(q, k, v) + total, parts

    one_graph_like_eager(attention_heads, *(torch.randn(2, 3, 8, requires_grad=True) for _ in range(3)))


def test_generator_function_interleaves_with_its_loop_as_in_eager():
    def scaled(xs, log):
        for i, x in enumerate(xs):
            log.append(len(log))  # the body sees what the loop appended after the previous item
            yield x * (len(log) + i)

    def f(x, y):
        log = []
        out = []
        for z in scaled((x, y, x + y), log):
            log.append(-1)
            out.append(z)
        return torch.stack(out), torch.tensor(log)

    one_graph_like_eager(f, torch.randn(4), torch.randn(4))


def test_generator_method_of_a_module():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])

        def blocks(self):
            yield from ()  # an empty delegation first: a generator whose body starts with SEND
            for layer in self.layers:
                yield layer

        def forward(self, x):
            for layer in self.blocks():
                x = torch.tanh(layer(x))
            return x

    model = Stack()
    # `yield from` is not traced: the frame runs eagerly, with eager's answer.
    compiled = kiln.compile(model)
    x = torch.randn(2, 6)
    torch.testing.assert_close(compiled(x), model(x))


def test_generator_that_never_ends_is_not_unrolled_forever():
    def counter():
        n = 0
        while True:
            yield n
            n += 1

    def f(x):
        for n, _ in zip(counter(), range(3)):  # eager stops after three; the trace drains zip's arguments
            x = x + n                          # first, gives up at its item cap and runs the frame eagerly
        return x

    compiled = kiln.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x + 3)
    assert stats()["fallbacks"] == 1, stats()


def test_generator_live_at_a_graph_break_runs_eagerly():
    def f(x):
        gen = (x * k for k in range(3))
        first = next(iter([x]))  # builtins the trace handles
        print("kiln generator test")  # a break while `gen` is live: not rebuilt, the frame runs eagerly
        return sum(gen) + first

    compiled = kiln.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), f(x))


def test_all_and_any_over_generators_are_traced_and_stop_where_eager_stops():
    def f(x, sizes):
        # all() stops at 1, before the tensor: evaluating bool(x > 0) would be a data-dependent branch
        first = all(s > 1 for s in sizes + (x > 0,))
        second = any(s == 3 for s in sizes)
        third = all(t.dim() == 1 for t in (x, x + 1))
        return x * 2 + (1 if first else 0) + (10 if second else 0) + (100 if third else 0)

    x = torch.randn(4)
    torch.testing.assert_close(kiln.compile(f)(x, (2, 1, 3)), f(x, (2, 1, 3)))
    assert stats()["graph_breaks"] == 0 and stats()["fallbacks"] == 0, stats()


def test_identity_of_a_tensor_passed_through_star_args():
    def inner(*args):
        return args[0] * (2 if args[0] is args[1] else 3)

    def f(x):
        y = x + 1
        return inner(y, y), inner(y, y + 0)

    x = torch.randn(3)
    out = kiln.compile(f)(x)
    torch.testing.assert_close(out[0], (x + 1) * 2)
    torch.testing.assert_close(out[1], (x + 1) * 3)
    assert stats()["graph_breaks"] == 0, stats()


class _Scaled:
    scale = 2.0
    made = 0

    def __init__(self):
        type(self).made += 1  # read and written through type(self): a break at the store


def test_class_attributes_read_through_type_are_guarded():
    # type(obj).attr was folded at trace time with no guard on the attribute: a changed class attribute kept the
    # first call's value (a counter stuck at 1, a scale that never changed).
    def f(x, obj):
        return x * type(obj).scale

    def g(x):
        _Scaled()
        return x + 1

    compiled_f, compiled_g = kiln.compile(f), kiln.compile(g)
    x, obj = torch.randn(4), _Scaled()
    for scale in (2.0, 3.0, 2.0):
        _Scaled.scale = scale
        torch.testing.assert_close(compiled_f(x, obj), x * scale)
    _Scaled.made = 0
    for _ in range(4):
        compiled_g(x)
    assert _Scaled.made == 4


def test_parameters_sharing_paths_are_read_afresh_on_every_call():
    # A call reads its graph inputs through paths that share prefixes (self.mids.0.leaves.3.w); each value is
    # the one the path reaches now: in-place updates, a replaced parameter, a replaced submodule.
    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

    class Mid(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaves = nn.ModuleList([Leaf() for _ in range(3)])

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.mids = nn.ModuleList([Mid() for _ in range(3)])

        def forward(self, x):
            for i, m in enumerate(self.mids):
                for leaf in m.leaves:
                    x = x * (i + 1) + leaf.w
            return x

    model = Top()
    compiled = kiln.compile(model)
    x = torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model.mids[1].leaves[2].w.mul_(3)
        torch.testing.assert_close(compiled(x), model(x))
        model.mids[2].leaves[0].w = nn.Parameter(torch.randn(4))
        torch.testing.assert_close(compiled(x), model(x))
        model.mids[0] = Mid()
        torch.testing.assert_close(compiled(x), model(x))
    kiln.reset()


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_hook_added_after_compiling_runs(kind):
    # The traced modules' hook dicts are guarded empty: a hook registered later on a submodule makes the next call
    # miss the compiled code, and the hook runs as in eager; removed again, the calls match eager again.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = kiln.compile(model)
    x = torch.randn(3, 4, requires_grad=kind == "full_backward")
    torch.testing.assert_close(compiled(x), model(x))
    calls = []
    if kind == "forward":
        handle = model[0].register_forward_hook(lambda m, args, out: calls.append(1) or out * 2)
    elif kind == "forward_pre":
        handle = model[0].register_forward_pre_hook(lambda m, args: calls.append(1) or (args[0] + 1,))
    else:
        handle = model[0].register_full_backward_hook(lambda m, gin, gout: calls.append(1))
    out = compiled(x)
    if kind == "full_backward":
        out.sum().backward()
    assert calls == [1]
    calls.clear()
    expected = model(x)
    if kind != "full_backward":
        assert calls == [1]
    torch.testing.assert_close(out, expected)
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_a_changed_attribute_of_a_built_in_module_recompiles():
    # A built-in module's plain attributes are guarded together (one check of its __dict__): each change is seen.
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Dropout(0.5)).eval()
    compiled = kiln.compile(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model[1].eps = 0.5
        torch.testing.assert_close(compiled(x), model(x))
        model[2].p = 0.0
        model.train()  # dropout with p = 0 in training mode: the identity, as in eager
        torch.testing.assert_close(compiled(x), model(x))
        model[0].out_features = 8  # the same value: no change
        torch.testing.assert_close(compiled(x), model(x))
    assert stats()["recompiles"] >= 2, stats()


def _swap_class(module, cls):
    module.__class__ = cls


def _replace_dict(module, **changes):
    module.__dict__ = dict(module.__dict__, **changes)


SNAPSHOT_CHANGES = {
    "constant": lambda m: setattr(m[1], "eps", 0.5),
    "training flag": lambda m: m.train(),
    "submodule": lambda m: m.__setitem__(3, nn.Tanh()),
    "parameter object": lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(8, 4))),
    "parameter shape": lambda m: setattr(m[0].weight, "data", torch.randn(8, 1).expand(8, 4)),
    "requires_grad": lambda m: m[0].weight.requires_grad_(False),
    "forward hook": lambda m: m[1].register_forward_hook(lambda mod, args, out: out * 2),
    "class": lambda m: _swap_class(m[3], nn.Tanh),
    "__dict__ replaced": lambda m: _replace_dict(m[1], eps=0.5),
}


@pytest.mark.parametrize("change", list(SNAPSHOT_CHANGES))
def test_a_change_after_guards_were_snapshotted_is_seen(change):
    # After a call whose guards pass, the next calls check a snapshot (guard_tree.h, GuardTree::Snapshot): the
    # module tree's dicts by version tag, tensors and types again. Each change below, made after several calls
    # on the snapshot, must give eager's result on the next call.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Dropout(0.0), nn.ReLU(), nn.Linear(8, 2)).eval()
    compiled = kiln.compile(model)
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x))
    assert stats()["guard_snapshot_hits"] >= 1, stats()  # the third call was checked on the snapshot
    SNAPSHOT_CHANGES[change](model)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x))
    kiln.reset()


def test_a_module_attribute_set_every_call_keeps_results_right():
    # A dict of the module tree changing between every two calls makes each snapshot stale at once: the guards
    # walk the tree instead (and stop taking snapshots), with eager's results throughout.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def forward(self, x):
            return self.body(x)

    model = Net().eval()
    compiled = kiln.compile(model)
    for step in range(20):
        model.step = step  # not read by forward: not guarded, but its __dict__ changes
        if step == 10:
            model.body[1].inplace = True
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), model(x))
    assert stats()["guard_snapshots_stale"] >= 1, stats()
    kiln.reset()


torch.library.define("kiln_test::twice", "(Tensor x) -> Tensor")


@torch.library.impl("kiln_test::twice", "CompositeExplicitAutograd")
def _twice(x):
    return x * 2


@torch.library.register_fake("kiln_test::twice")
def _twice_fake(x):
    return torch.empty_like(x)


def test_torch_ops_calls_are_captured():
    """torch.ops.aten.<op>.<overload> and custom ops (torch.library, with a fake kernel) are recorded in the graph:
    operator objects are made once and cached on their namespace, so the tracer pins them by identity."""
    def f(x):
        y = torch.ops.aten._safe_softmax.default(x * 2, -1) + torch.ops.aten.relu(x)
        return torch.ops.kiln_test.twice(y.sin()).cos()

    x = torch.randn(4, 5)
    assert_same_as_eager(f, x)
    explanation = kiln.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = explanation.ops_per_graph[0]
    assert "aten::_safe_softmax.default" in ops and "kiln_test::twice.default" in ops, ops


class _Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.scales = nn.ParameterList([nn.Parameter(torch.full((4,), i + 1.0)) for i in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})
        self.offsets = nn.ParameterDict({"a": nn.Parameter(torch.zeros(2)), "b": nn.Parameter(torch.ones(3))})

    def forward(self, x):
        for layer, scale in zip(self.layers, self.scales):
            x = torch.tanh(layer(x)) * scale
        out = [self.heads[k](x) + self.offsets[k] for k in self.heads]
        return out + [sum(p.sum() for p in self.scales), [k for k in self.offsets]]


def test_module_containers_iterate_as_their_own_iter():
    """ModuleList and Sequential yield their children, ModuleDict and ParameterDict their keys, ParameterList its
    parameters (a loop over one once ran zero times); gradients reach the parameters; adding an item recompiles."""
    m = _Containers()
    x = torch.randn(3, 4, requires_grad=True)
    assert_same_as_eager(m, x)
    compiled = kiln.compile(m)
    assert compiled(x)[-1] == ["a", "b"]
    m.scales.append(nn.Parameter(torch.full((4,), 3.0)))
    m.layers.append(nn.Linear(4, 4))
    m.offsets["c"] = nn.Parameter(torch.ones(1))
    m.heads["c"] = nn.Linear(4, 1)
    expected = m(x)
    actual = compiled(x)
    assert actual[-1] == ["a", "b", "c"] and len(actual) == len(expected)
    for a, e in zip(actual[:-1], expected[:-1]):
        torch.testing.assert_close(a, e)


def test_a_module_with_its_own_iter_runs_it_eagerly():
    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def __iter__(self):
            return iter([self.b, self.a])

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.pairs = Pairs()

        def forward(self, x):
            for layer in self.pairs:
                x = layer(x).relu()
            return x

    assert_same_as_eager(M(), torch.randn(2, 3))


def test_finfo_and_iinfo_fold_to_constants():
    """torch.finfo(dtype).min (HF's attention masks) and torch.iinfo are read at trace time: no graph break."""
    def f(x, mask):
        big = torch.iinfo(torch.int32).max
        return x.masked_fill(mask, torch.finfo(x.dtype).min).softmax(-1) * (big > 0)

    x, mask = torch.randn(2, 5), torch.rand(2, 5) > 0.5
    assert_same_as_eager(f, x, mask)
    assert kiln.explain(f)(x, mask).graph_break_count == 0
    assert_same_as_eager(f, x.double(), mask)  # another dtype: finfo of float64, a new trace


def test_item_assignment_to_tensors_is_traced():
    """x[i] = v is recorded (no graph break); a write into an input changes the caller's tensor as eager does, and a
    write into a leaf that requires grad raises as eager does."""
    def f(x, v):
        x[1:3] = v
        return x * 2

    x, v = torch.randn(4, 3), torch.randn(2, 3)
    x_eager = x.clone()
    torch.testing.assert_close(kiln.compile(f)(x, v), f(x_eager, v))
    torch.testing.assert_close(x, x_eager)
    assert kiln.explain(f)(x.clone(), v).graph_break_count == 0
    leaf = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf|in-place"):
        kiln.compile(f)(leaf, v)


def test_stateless_builtin_modules_made_inside_forward_are_traced():
    """`nn.ReLU()(x)` (DistilBERT's classifier head), `nn.Softmax(dim=-1)(x)`: a built-in module without parameters
    made with constant arguments inside traced code is built at trace time and called like any built-in module,
    with no graph break; gradients match eager's."""
    def f(x):
        y = nn.ReLU()(x) + nn.Softmax(dim=-1)(x) + nn.GELU(approximate="tanh")(x) + nn.LeakyReLU(0.2)(x)
        return nn.Flatten(1)(y.unsqueeze(-1)) * 2

    x = torch.randn(4, 5, requires_grad=True)
    assert_same_as_eager(f, x)
    explained = kiln.explain(f)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_dropout_made_inside_forward_is_in_training_mode_as_in_eager():
    """A fresh nn.Dropout is in training mode even under an eval() model, in eager and in kiln."""
    class M(nn.Module):
        def forward(self, x):
            return nn.Dropout(0.5)(x)

    m = M().eval()
    out = kiln.compile(m)(torch.ones(20000))
    assert kiln.explain(m)(torch.ones(20000)).graph_break_count == 0
    zeros = (out == 0).float().mean().item()
    assert 0.45 < zeros < 0.55, zeros
    assert torch.equal(out[out != 0], torch.full_like(out[out != 0], 2.0))


def test_modules_with_parameters_made_inside_forward_break_without_moving_the_generator():
    """nn.Linear(5, 3) made in forward draws its initial weights from torch's generator: it stays eager (a graph
    break), and the trace that tried it leaves the generator where eager finds it."""
    def f(x):
        return nn.Linear(5, 3)(x)

    x = torch.randn(2, 5)
    torch.manual_seed(7)
    compiled = kiln.compile(f)(x)
    torch.manual_seed(7)
    assert torch.equal(compiled, f(x))
    assert kiln.explain(f)(x).graph_break_count >= 1


def test_isinstance_with_a_tuple_of_classes_built_in_the_frame():
    """`isinstance(mask, (torch.Tensor, SomeClass))` (HF's mask preparation): the tuple is built by the frame's own
    bytecode, its classes are constants, and the test folds at trace time."""
    class Marker:
        pass

    def f(x, mask):
        if isinstance(mask, (torch.Tensor, Marker)) and len(mask.shape) == 2:
            x = x.masked_fill(mask, 0.0)
        if isinstance(x, (int, Marker)):
            x = x + 100
        return x * 2

    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    assert_same_as_eager(f, x, mask)
    assert_same_as_eager(f, x, None)
    assert kiln.explain(f)(x, mask).graph_break_count == 0


class _SlicedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
        self.n = 3

    def forward(self, x):
        for layer in self.layers[: self.n]:  # HF's decoder loops: self.layers[: self.config.num_hidden_layers]
            x = layer(x).relu()
        for layer in self.layers[::-2]:
            x = layer(x)
        rest = self.layers[1:]
        assert isinstance(rest, nn.ModuleList) and type(rest) is nn.ModuleList and len(rest) == len(self.layers) - 1
        return rest[0](x) + rest[-1](x) + len(self.layers[3:][1:])


def test_slices_of_a_module_list_are_traced_and_guarded():
    """`self.layers[:n]` is a ModuleList of those children in eager: traced as their list (typed ModuleList for
    isinstance and type()), one graph; appending a layer or changing n recompiles."""
    m = _SlicedLayers()
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_as_eager(m, x)
    explained = kiln.explain(m)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    m.layers.append(nn.Linear(4, 4))
    assert_same_as_eager(m, x)
    m.n = 5
    assert_same_as_eager(m, x)


def test_a_module_list_slice_leaving_the_trace_is_a_module_list():
    """Returned, the slice is a real ModuleList of the same children; live at a graph break, the frame runs eagerly
    (rebuilt, it would have been a plain list)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))

        def forward(self, x, log):
            head = self.layers[:2]
            log.append(len(head))  # a mutation of an outside list: a graph break with `head` live
            for layer in head:
                x = layer(x)
            return x, self.layers[3:]

    m = M()
    x = torch.randn(2, 4)
    log = []
    out, rest = kiln.compile(m)(x, log)
    assert type(rest) is nn.ModuleList and list(rest) == list(m.layers)[3:]
    torch.testing.assert_close(out, m(x, [])[0])
    assert log == [2]


def test_negative_index_into_a_module_list_follows_appends():
    """`self.layers[-1]` after an append is the new last layer in eager: the container's keys are guarded, so the
    call recompiles (the old last layer's own entry in _modules still passes its identity check)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            return self.layers[-1](x) + self.layers[0](x)

    m = M()
    x = torch.randn(2, 4)
    compiled = kiln.compile(m)
    torch.testing.assert_close(compiled(x), m(x))
    m.layers.append(nn.Linear(4, 4))
    torch.testing.assert_close(compiled(x), m(x))


def test_len_of_module_containers_is_guarded():
    """`for i in range(len(self.layers))`, `len(self.scales)` and `if self.extra:` fold to the trace-time lengths,
    guarded on the containers' keys and ParameterList's size: appending to any recompiles (each silently kept the
    old length before)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.scales = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(2))
            self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})
            self.extra = nn.ModuleList()

        def forward(self, x):
            for i in range(len(self.layers)):
                x = self.layers[i](x)
            if self.extra:  # its truth is its length
                x = x + 1000
            return x * len(self.scales) + len(self.heads)

    m = M()
    x = torch.randn(2, 4)
    compiled = kiln.compile(m)
    torch.testing.assert_close(compiled(x), m(x))
    assert kiln.explain(m)(x).graph_break_count == 0
    m.layers.append(nn.Linear(4, 4))
    torch.testing.assert_close(compiled(x), m(x))
    m.scales.append(nn.Parameter(torch.randn(4)))
    torch.testing.assert_close(compiled(x), m(x))
    m.heads["b"] = nn.Linear(4, 2)
    torch.testing.assert_close(compiled(x), m(x))
    m.extra.append(nn.Identity())
    torch.testing.assert_close(compiled(x), m(x))


def test_key_in_a_module_dict_is_traced_and_guarded():
    """`"b" in self.heads` of a ModuleDict (or ParameterDict) reads its keys, guarded: adding the key recompiles."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})
            self.bias = nn.ParameterDict({"a": nn.Parameter(torch.zeros(2))})

        def forward(self, x):
            y = self.heads["a"](x)
            if "b" in self.heads:
                y = y + self.heads["b"](x)
            if "b" not in self.bias:
                y = y * 2
            return y

    m = M()
    x = torch.randn(3, 4)
    compiled = kiln.compile(m)
    torch.testing.assert_close(compiled(x), m(x))
    assert kiln.explain(m)(x).graph_break_count == 0
    m.heads["b"] = nn.Linear(4, 2)
    torch.testing.assert_close(compiled(x), m(x))
    m.bias["b"] = nn.Parameter(torch.ones(2))
    torch.testing.assert_close(compiled(x), m(x))


def test_hasattr_and_getattr_with_a_default_on_a_module_are_guarded():
    """`hasattr(self, "extra")` and `getattr(self, "gain", 1.0)` on a module: setting the attribute later recompiles
    (hasattr kept answering False before)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x) * getattr(self, "gain", 1.0)
            if hasattr(self, "extra"):
                y = y + self.extra(x)
            return y

    m = M()
    x = torch.randn(2, 4)
    compiled = kiln.compile(m)
    torch.testing.assert_close(compiled(x), m(x))
    m.extra = nn.Linear(4, 4)
    torch.testing.assert_close(compiled(x), m(x))
    m.gain = 3.0
    torch.testing.assert_close(compiled(x), m(x))
    del m.extra
    torch.testing.assert_close(compiled(x), m(x))


def test_container_items_are_reached_by_position_and_parameter_lists_are_traced():
    """`self.layers[2]` is the entry index 2 names, even when the same module also sits at index 0 (replacing
    entry 2 recompiles); a Sequential's items by position (its keys are names); `self.scales[i]` of a ParameterList
    is traced (it was a graph break), and an in-place update of the parameter is seen."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Linear(4, 4)
            self.layers = nn.ModuleList([shared, nn.Linear(4, 4), shared])
            self.seq = nn.Sequential()
            self.seq.add_module("first", nn.Linear(4, 4))
            self.seq.add_module("second", nn.Tanh())
            self.scales = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(2))

        def forward(self, x):
            return (self.layers[2](x) + self.seq[0](x) + self.seq[-1](x)) * self.scales[0] + self.scales[-1]

    m = M()
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_as_eager(m, x)
    assert kiln.explain(m)(x).graph_break_count == 0
    compiled = kiln.compile(m)
    m.layers[2] = nn.Linear(4, 4)
    torch.testing.assert_close(compiled(x), m(x))
    with torch.no_grad():
        m.scales[0].mul_(3)
    torch.testing.assert_close(compiled(x), m(x))
    m.scales.append(nn.Parameter(torch.randn(4)))
    torch.testing.assert_close(compiled(x), m(x))


# --- environment variables ---------------------------------------------------------------------------------

def _reads_environment(x):
    if os.environ.get("KILN_TEST_SCALE", "0") == "1":
        x = x * 2
    if "KILN_TEST_SHIFT" in os.environ:
        x = x + float(os.environ["KILN_TEST_SHIFT"])
    if os.getenv("KILN_TEST_SIGN") == "-":
        x = -x
    return x.sin()


def test_environment_variables_read_in_traced_code_are_guarded(monkeypatch):
    # os.environ.get, `in`, os.environ[...] and os.getenv read the variable at trace time; a guard reads it again
    # on every call (transformers reads them in its attention paths), so a changed variable recompiles.
    for name in ("KILN_TEST_SCALE", "KILN_TEST_SHIFT", "KILN_TEST_SIGN"):
        monkeypatch.delenv(name, raising=False)
    compiled = kiln.compile(_reads_environment)
    x = random_tensor(5)
    settings = [{}, {"KILN_TEST_SCALE": "1"}, {"KILN_TEST_SCALE": "1", "KILN_TEST_SHIFT": "0.5"},
                {"KILN_TEST_SHIFT": "-2", "KILN_TEST_SIGN": "-"}, {"KILN_TEST_SHIFT": "3"}, {}]
    for env in settings:
        for name in ("KILN_TEST_SCALE", "KILN_TEST_SHIFT", "KILN_TEST_SIGN"):
            if name in env:
                monkeypatch.setenv(name, env[name])
            else:
                monkeypatch.delenv(name, raising=False)
        torch.testing.assert_close(compiled(x), _reads_environment(x))
    stats = kiln.stats()
    assert (stats["graph_breaks"], stats["fallbacks"]) == (0, 0), stats
    assert stats["frames_compiled"] == 5 and stats["cache_hits"] == 1, stats  # the last setting is the first's
    guards = kiln.explain(_reads_environment)(x).guards
    assert "os.environ.get('KILN_TEST_SHIFT') == None" in guards, guards


def test_reading_an_unset_environment_variable_by_subscript_raises_as_eager(monkeypatch):
    monkeypatch.delenv("KILN_TEST_UNSET", raising=False)

    def f(x):
        return x + float(os.environ["KILN_TEST_UNSET"])

    with pytest.raises(KeyError, match="KILN_TEST_UNSET"):
        kiln.compile(f)(random_tensor(3))


# --- questions about who runs the code, and process-state queries ----------------------------------

def test_is_compiling_answers_true_inside_traces_as_under_torch_compile():
    """torch.compiler.is_compiling() inside kiln's traces answers True, as under
    torch.compile, so libraries skip what only eager needs; torch.jit.is_scripting() and torch.compiler.is_exporting()
    answer False. The answers are constants of the trace: no graph break. Outside a trace eager answers False."""
    def f(x):
        if torch.jit.is_scripting() or torch.compiler.is_exporting():
            return x * 5
        if torch.compiler.is_compiling():
            return x * 2
        return x * 3

    x = random_tensor(5)
    compiled = kiln.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 2)
    torch.testing.assert_close(f(x), x * 3)


def test_process_state_queries_are_guarded_and_a_new_answer_recompiles():
    """torch.are_deterministic_algorithms_enabled() (like torch.cuda.is_current_stream_capturing()) is answered at
    trace time and asked again on every call: flipping it recompiles rather than replaying the old branch."""
    def f(x):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # raises without CUDA, as eager
            return x.cos()
        if torch.are_deterministic_algorithms_enabled():
            return x + 1
        return x - 1

    x = random_tensor(5)
    compiled = kiln.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x), x - 1)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.testing.assert_close(compiled(x), x + 1)
    finally:
        torch.use_deterministic_algorithms(before)
    torch.testing.assert_close(compiled(x), x - 1)
    stats = kiln.stats()
    assert stats["frames_compiled"] == 2 and stats["graph_breaks"] == 0, stats


class LayerFlags:
    """An object holding a dict keyed by layer index, as transformers' EncoderDecoderCache.is_updated is."""

    def __init__(self):
        self.updated = {0: False, 1: True, None: False}


def test_dicts_with_int_keys_from_outside_are_read_in_the_trace_and_guarded():
    def f(x, flags, layer):
        if flags.updated.get(layer) or flags.updated[None]:
            return x + 1
        return x * 2 if 1 in flags.updated else x

    flags = LayerFlags()
    compiled = kiln.compile(f, fullgraph=True)
    x = random_tensor(4)
    for layer in (0, 1, 0):
        torch.testing.assert_close(compiled(x, flags, layer), f(x, flags, layer))
    flags.updated[0] = True  # a value read by the trace changed: the guard on flags.updated[0] fails
    torch.testing.assert_close(compiled(x, flags, 0), x + 1)
    flags.updated[2] = False  # a new key: the keys' guard fails
    torch.testing.assert_close(compiled(x, flags, 2), f(x, flags, 2))
    assert kiln.stats()["graph_breaks"] == 0


class Table:
    def __init__(self):
        self.rows = {0: 1.5, "scale": 2.0}


def test_changes_to_dicts_from_outside_are_made_on_the_real_dict_after_the_graph():
    """d[k] = v, d.pop(k), d.update(...) and del d[k] on dicts the frame reads (an object's table, an argument)
    change the trace's view of the dict, and the compiled frame makes the real dict equal to it after the graph:
    the caller sees eager's dict, the same object, through every path to it."""
    def f(x, table, state):
        table.rows[1] = 3.0
        y = x * table.rows.pop("scale")
        state["acc"] = state["acc"] + y
        state.update({"calls": state.get("calls", 0) + 1})
        same = table.rows  # another read of the same dict sees the change
        del state["scratch"]
        return y + same[1]

    def run(fn):
        table, state = Table(), {"acc": torch.ones(4), "scratch": None}
        out = fn(x, table, state)
        return out, table.rows, state

    x = random_tensor(4)
    compiled = kiln.compile(f, fullgraph=True)
    for _ in range(2):
        expected, rows, state = run(f)
        actual, compiled_rows, compiled_state = run(compiled)
        torch.testing.assert_close(actual, expected)
        assert compiled_rows == rows and list(compiled_rows) == list(rows)
        assert list(compiled_state) == list(state) and compiled_state["calls"] == state["calls"]
        torch.testing.assert_close(compiled_state["acc"], state["acc"])
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1


def test_a_dict_changed_before_a_graph_break_is_changed_when_the_break_runs():
    seen = []

    def f(x, state):
        state["y"] = x.sin()
        seen.append(dict(state))  # a graph break: runs in Python, must see the new item
        return state["y"] * 2

    x = random_tensor(3)
    state = {}
    out = kiln.compile(f)(x, state)
    torch.testing.assert_close(out, x.sin() * 2)
    assert list(state) == ["y"] and list(seen[0]) == ["y"]
    torch.testing.assert_close(seen[0]["y"], x.sin())


def test_functions_under_torch_compiler_disable_are_a_graph_break():
    @torch.compiler.disable
    def helper(x):
        return x * 2

    def f(x):
        return helper(x.sin()) + 1

    x = random_tensor(3)
    explained = kiln.explain(f)(x)
    assert "a function under torch.compiler.disable" in explained.break_reasons[0], explained.break_reasons
    assert "eval_frame" not in " ".join(explained.break_reasons)  # torch's wrapper itself is not traced
    torch.testing.assert_close(kiln.compile(f)(x), f(x))


class SimpleNamespaceLike:
    """A plain object (pinned by type): callable() answers from its class."""


def test_callable_of_traced_values():
    def f(x, fn, module, config):
        hits = callable(x) + callable(fn) * 2 + callable(module) * 4 + callable(config) * 8 + callable((x,)) * 16
        return x * hits

    x = random_tensor(3)
    args = (x, torch.sin, nn.Linear(3, 3), SimpleNamespaceLike())
    torch.testing.assert_close(kiln.compile(f, fullgraph=True)(*args), f(*args))


# A module-level registry keyed by classes and typing forms (a validator table, a dispatch-by-type dict).
import typing as _typing  # noqa: E402

_SCALE_BY_KIND = {list: 2.0, tuple: 3.0, _typing.Union: 5.0, _typing.Literal: 7.0}


def test_dict_keyed_by_classes_and_typing_forms_is_read_in_the_trace(fresh_kiln):
    def f(x, kind):
        scale = _SCALE_BY_KIND.get(kind)
        return x * (scale if scale is not None else -1.0)

    x = random_tensor(5)
    for kind in (list, _typing.Literal, dict):
        explained = kiln.explain(f)(x, kind)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        assert_same_as_eager(f, x, kind)
    compiled = kiln.compile(f)
    torch.testing.assert_close(compiled(x, tuple), x * 3.0)
    _SCALE_BY_KIND[tuple] = 4.0  # the registry changes: the guard on its items sees it
    try:
        torch.testing.assert_close(compiled(x, tuple), x * 4.0)
    finally:
        _SCALE_BY_KIND[tuple] = 3.0


def test_attributes_set_on_input_tensors_are_read_from_them_and_guarded():
    # hasattr(x, "scale") once asked the fake, which never has the program's own attributes: False where eager
    # said True, a silent wrong answer.
    def f(x):
        return x * getattr(x, "scale", 1.0) + hasattr(x, "scale") + (x.offset if hasattr(x, "offset") else 0)

    compiled = kiln.compile(f)
    plain = random_tensor(3)
    scaled = random_tensor(3)
    scaled.scale = 3.0
    both = random_tensor(3)
    both.scale, both.offset = 5.0, 7
    for x in [scaled, plain, both, scaled, plain]:
        torch.testing.assert_close(compiled(x), f(x))
    assert stats()["graph_breaks"] == 0 and stats()["fallbacks"] == 0, stats()
    scaled.scale = 4.0  # the value read is guarded
    torch.testing.assert_close(compiled(scaled), f(scaled))


def test_numpy_arrays_passed_to_torch_are_read_on_every_call():
    # A numpy array argument is pinned by its type only; torch.from_numpy(a) / torch.tensor(a) / torch.as_tensor(a)
    # once baked the first call's contents into the graph: every later call returned the first call's values.
    np = pytest.importorskip("numpy")

    def from_numpy(x, a):
        return x + torch.from_numpy(a)

    def tensor_of(x, a):
        return x * torch.tensor(a) + torch.as_tensor(a)

    def of_a_numpy_scalar(x):
        return torch.tensor(x.numpy().sum()) + x  # a numpy scalar made at a break, read by the resumed frame

    rng = np.random.default_rng(0)
    for fn in (from_numpy, tensor_of):
        compiled = kiln.compile(fn)
        for _ in range(3):
            x, a = random_tensor(3), rng.standard_normal(3).astype(np.float32)
            torch.testing.assert_close(compiled(x, a), fn(x, a))
    compiled = kiln.compile(of_a_numpy_scalar)
    for _ in range(3):
        x = random_tensor(3)
        torch.testing.assert_close(compiled(x), of_a_numpy_scalar(x))


def test_requires_grad_turned_on_inside_compiled_code_is_honoured():
    # `y.requires_grad_(True)` on a value that did not require grad was recorded as nothing: the output came back
    # without grad_fn where eager's requires grad.
    def on_a_clone(x):
        y = x.clone()
        y.requires_grad_(True)
        return y * 2, y

    def on_the_input(x):
        x.requires_grad_()
        return (x * 3).sum()

    compiled = kiln.compile(on_a_clone)
    x = random_tensor(4)
    out, y = compiled(x)
    ref_out, ref_y = on_a_clone(x)
    assert out.requires_grad and y.requires_grad and y.is_leaf and not x.requires_grad
    torch.testing.assert_close(out, ref_out)
    out.sum().backward()
    ref_out.sum().backward()
    torch.testing.assert_close(y.grad, ref_y.grad)

    compiled = kiln.compile(on_the_input)
    x = random_tensor(4)
    compiled(x).backward()
    assert x.requires_grad
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


@functools.lru_cache(maxsize=None)
def _cached_scale(n):
    return 0.5 * n


@functools.cache
def _cached_mask(n):
    return torch.ones(n, n).tril()


def test_functools_cached_functions_are_traced_without_a_break():
    # An lru_cache / cache wrapper was pinned by its type only, so every call of one was a graph break.
    def f(x):
        return x * _cached_scale(x.shape[0]) + _cached_mask(x.shape[0]) @ x

    x = random_tensor(4, 4)
    e = kiln.explain(f)(x)
    kiln.reset()
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    assert_same_as_eager(f, x, grads=False)
    assert_same_as_eager(f, random_tensor(2, 4), grads=False)


def test_dict_popitem_and_update_with_keywords():
    def f(x):
        d = {"a": 1, "b": 2}
        d.update({"c": 3}, e=5)
        d.update(f=6)
        k, v = d.popitem()
        return x * v + d["e"], k, sorted(d)

    e = kiln.explain(f)(random_tensor(3))
    kiln.reset()
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    assert_same_as_eager(f, random_tensor(3), grads=False)


def test_ordered_dicts_and_devices_made_in_the_function():
    # torchvision's IntermediateLayerGetter builds an OrderedDict of features, RAFT calls torch.device(device): both
    # were graph breaks (a resume function per loop iteration for the OrderedDict's item assignments).
    import collections

    class Getter(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

        def forward(self, x):
            out = collections.OrderedDict()
            for name, layer in self.layers.items():
                x = layer(x)
                out[name] = x
            device = torch.device(str(x.device))
            out["grid"] = torch.arange(4, device=device) * x
            out.move_to_end("a")
            out.move_to_end("grid", False)
            return out

    model = Getter()
    x = random_tensor(2, 4)
    e = kiln.explain(model)(x)
    kiln.reset()
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    out = kiln.compile(model)(x)
    assert type(out) is collections.OrderedDict and list(out) == ["grid", "b", "a"]
    assert_same_as_eager(model, x)


def test_type_expressions_in_traced_code_are_constants():
    # timm's CrossViT: `torch.jit.annotate(List[torch.Tensor], [])` in a loop broke the graph at typing's
    # _GenericAlias on every iteration.
    from typing import Dict, List, Optional

    def f(xs):
        out = torch.jit.annotate(List[torch.Tensor], [])
        for x in xs:
            out.append(x * 2)
        spec = (Optional[int], Dict[str, torch.Tensor], tuple[int, ...])
        return out, len(spec)

    xs = [random_tensor(3), random_tensor(2)]
    e = kiln.explain(f)(xs)
    kiln.reset()
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    assert_same_as_eager(f, xs, grads=False)
