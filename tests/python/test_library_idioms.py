"""Idioms of library model code (transformers, timm) that once split graphs: list indices, partials kept on modules.

Each test compares with eager over several calls with fresh inputs and asserts the code is captured whole.
"""
import functools
from collections.abc import MutableMapping

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.testing import random_tensor


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def test_list_indices_are_read_as_tensors_of_their_values():
    # x[..., [-2], :] (Falcon's multi-query heads) made its index tensor on the fake's meta device, where the values
    # were lost: every such subscript was a graph break.
    def f(x, y):
        y = y.clone()
        y[[0, 2]] = x[[1, 1]]
        y[:, [3, 0]] *= 2
        return y, x[..., [-2], :] * 2, x[:, [0, 2]], x[([0, 1], [1, 0])]

    compiled = kiln.compile(f)
    for _ in range(3):
        x, y = random_tensor(3, 4, 5), random_tensor(3, 4, 5)
        for got, want in zip(compiled(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1


def test_a_boolean_list_index_inside_a_tuple_runs_eagerly():
    # A mask index has a size that depends on its data: a break, with eager's answer.
    def f(x):
        return x[:, [True, False, True, False]] + 1, x[[True, False, True]]

    compiled = kiln.compile(f)
    x = random_tensor(3, 4)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want)


def _scaled(x, k, scale=1.0):
    return x * k * scale


SHARED = functools.partial(torch.add, alpha=2)


class WithPartials(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = functools.partial(F.gelu, approximate="tanh")  # transformers' GELUTanh
        self.scaled = functools.partial(_scaled, k=3)

    def forward(self, x):
        return self.act(x) + self.scaled(x, scale=0.5) + SHARED(x, x)


def test_partials_kept_on_a_module_are_called_in_the_graph_and_guarded():
    m = WithPartials()
    compiled = kiln.compile(m)
    for _ in range(2):
        x = random_tensor(4, 6)
        torch.testing.assert_close(compiled(x), m(x))
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1
    # A new partial, and a changed keyword of the same partial, are seen on the next call.
    m.scaled = functools.partial(_scaled, k=5)
    x = random_tensor(4, 6)
    torch.testing.assert_close(compiled(x), m(x))
    m.scaled.keywords["k"] = 7
    torch.testing.assert_close(compiled(x), m(x))
    m.act = functools.partial(F.gelu, approximate="none")
    torch.testing.assert_close(compiled(x), m(x))


_KERNEL_CALLS = []


@torch.library.custom_op("kiln_idioms::scaled_tanh", mutates_args=())
def _scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    _KERNEL_CALLS.append(1)  # a Python side effect the frame hook must leave to the kernel
    return torch.tanh(x) * scale


@_scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _scaled_tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


_scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


def test_python_custom_ops_run_their_python_uncompiled():
    # A custom op's Python kernel and autograd glue (transformers' grouped_mm fallback) run while the compiled graph
    # runs; the frame hook once compiled them as frames of their own, with graph breaks at the glue's ctx writes.
    lin = nn.Linear(6, 6)

    def f(x):
        return torch.ops.kiln_idioms.scaled_tanh(lin(x), 3.0).sum(dim=1)

    compiled = kiln.compile(f)
    for _ in range(2):
        x = random_tensor(4, 6, requires_grad=True)
        _KERNEL_CALLS.clear()
        got = compiled(x)
        assert _KERNEL_CALLS == [1]
        got.sum().backward()
        got_grads = (x.grad, lin.weight.grad.clone())
        x.grad, lin.weight.grad = None, None
        want = f(x)
        want.sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, (x.grad, lin.weight.grad))
        lin.weight.grad = None
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["graph_breaks"] == 0, kiln.stats()


class _NotItsDerivative(torch.autograd.Function):
    """Old style (ctx in forward), with a backward that is deliberately not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * torch.sigmoid(1.702 * x) * k

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 100.0 + x * 0, None


class _NewStyle(torch.autograd.Function):
    @staticmethod
    def forward(x, y):
        return x * y + 1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        return grad * 7, grad * 3


class _WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _NewStyle.apply(_NotItsDerivative.apply(self.lin(x), 2.0), x).sum(1)


def test_custom_autograd_functions_are_inlined_where_no_gradient_can_flow():
    # Bloom's GeLUFunction: under no_grad (or with nothing requiring grad) apply is the forward, traced in the graph;
    # where a gradient flows, apply runs eagerly so that autograd calls the function's own backward.
    m = _WithFunctions()
    compiled = kiln.compile(m)
    with torch.no_grad():
        for _ in range(2):
            x = random_tensor(3, 4)
            torch.testing.assert_close(compiled(x), m(x))
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 1
    m.requires_grad_(False)  # grad mode on, nothing requires grad
    x = random_tensor(3, 4)
    torch.testing.assert_close(compiled(x), m(x))
    assert kiln.stats()["graph_breaks"] == 0
    m.requires_grad_(True)
    x = random_tensor(3, 4)
    compiled(x).sum().backward()
    got = m.lin.weight.grad.clone()
    m.zero_grad()
    m(x).sum().backward()
    torch.testing.assert_close(got, m.lin.weight.grad)  # the custom backward's gradient, not the derivative
    assert kiln.stats()["graph_breaks"] > 0


class _Registry(MutableMapping):
    """transformers' GeneralInterface: a class-wide mapping with local overrides, read through Mapping.get."""

    _shared = {"sin": torch.sin, "cos": torch.cos}

    def __init__(self):
        self._local = {}

    def __getitem__(self, key):
        if key in self._local:
            return self._local[key]
        return self._shared[key]

    def __setitem__(self, key, value):
        self._local[key] = value

    def __delitem__(self, key):
        del self._local[key]

    def __iter__(self):
        return iter({**self._shared, **self._local})

    def __len__(self):
        return len(self._shared) + len(self._local)


_REGISTRY = _Registry()
_TABLE = {"x": 1}


def test_missing_keys_of_dicts_read_from_outside_raise_a_key_error_the_code_catches():
    # A missing key of a dict from outside was a graph break; its keys are guarded, so it raises KeyError into the
    # traced code's own handler (Mapping.get's), and a key added later is seen.
    def f(x, name):
        fn = _REGISTRY.get(name, torch.tanh)
        try:
            k = _TABLE["y"]
        except KeyError:
            k = 5
        return fn(x) * k

    compiled = kiln.compile(f)
    for name in ("sin", "other", "cos", "other"):
        x = random_tensor(4)
        torch.testing.assert_close(compiled(x, name), f(x, name))
    assert kiln.stats()["graph_breaks"] == 0
    _TABLE["y"] = 2
    _Registry._shared["other"] = torch.exp
    try:
        x = random_tensor(4)
        torch.testing.assert_close(compiled(x, "other"), f(x, "other"))
    finally:
        del _TABLE["y"], _Registry._shared["other"]


def test_tuples_grown_from_an_empty_constant_and_repeated():
    # PoolFormer's `outputs = (); outputs = (output,) + outputs` broke the graph at every layer.
    def f(x, n):
        outputs = ()
        outputs = (x * 2,) + outputs
        more = ()
        more += (x + 1,)
        return outputs + more + (1, 2) + (x,) * n + tuple([x - 1] * 2 + [x]) + tuple(3 * [x.sum()])

    compiled = kiln.compile(f)
    x = random_tensor(3)
    got, want = compiled(x, 2), f(x, 2)
    assert len(got) == len(want) and kiln.stats()["graph_breaks"] == 0
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)
        else:
            assert g == w


class _Finalized:
    collected = []

    def __init__(self):
        self.cycle = self  # only the cyclic collector frees it

    def __del__(self):
        _Finalized.collected.append(torch.ones(2).sum())


def test_finalizers_the_collector_runs_inside_compiled_code_are_not_compiled():
    # A __del__ run by a collection that happened to start inside a compiled call was intercepted by the hook and
    # compiled as a frame of its own (regex's Group.__del__ under transformers, counted as a cache hit later).
    import gc

    def f(x):
        y = x * 2
        gc.collect()  # a graph break: runs eagerly, with the hook active for what it calls
        return y + 1

    _Finalized()
    compiled = kiln.compile(f)
    x = random_tensor(3)
    torch.testing.assert_close(compiled(x), f(x))
    assert _Finalized.collected, "the finalizer did not run"
    assert kiln._core.frame.entries(_Finalized.__del__) == 0
    assert not kiln._core.frame.is_skipped(_Finalized.__del__)


def test_defaultdicts_made_in_the_function_are_traced_and_returned_with_their_factory():
    import collections

    def f(x):
        groups = collections.defaultdict(list)
        groups["a"].append(x)
        groups["b"].append(x * 2)
        groups["a"].append(x + 1)
        counts = collections.defaultdict(int)
        for key in ("p", "q", "p"):
            counts[key] += 1
        fallback = collections.defaultdict(lambda: 7, {"z": 1})
        total = sum(t.sum() for t in groups["a"]) + groups["b"][0] * counts["p"] + fallback["w"] + fallback["z"]
        return total, groups, counts, "a" in groups, groups.get("zz"), sorted(fallback)

    compiled = kiln.compile(f)
    for _ in range(3):
        x = random_tensor(4)
        got, want = compiled(x), f(x)
        torch.testing.assert_close(got[0], want[0])
        assert type(got[1]) is collections.defaultdict and got[1].default_factory is list
        assert list(got[1]) == list(want[1]) and dict(got[2]) == dict(want[2]) and got[3:] == want[3:]
        for a, b in zip(got[1]["a"], want[1]["a"]):
            torch.testing.assert_close(a, b)
        got[1]["new"].append(1)  # the returned one is a working defaultdict
        got[2]["n"] += 1
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["graph_breaks"] == 0, kiln.stats()


def test_namedtuple_replace_is_traced():
    import collections

    Pair = collections.namedtuple("Pair", "tensor scale")

    def f(x):
        first = Pair(x * 2, 3)
        second = first._replace(scale=5)
        third = second._replace(tensor=second.tensor + 1, scale=second.scale - 1)
        return first.tensor * first.scale + second.tensor * second.scale, third

    compiled = kiln.compile(f)
    for _ in range(3):
        x = random_tensor(4)
        got, want = compiled(x), f(x)
        torch.testing.assert_close(got[0], want[0])
        assert type(got[1]) is Pair and got[1].scale == want[1].scale == 4
        torch.testing.assert_close(got[1].tensor, want[1].tensor)
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["graph_breaks"] == 0, kiln.stats()
    with pytest.raises(ValueError):  # a name that is no field raises as in eager
        kiln.compile(lambda x: Pair(x, 1)._replace(nope=2))(random_tensor(2))


def test_identity_of_an_annotation_and_a_class_is_settled_by_their_types():
    # typing.get_origin(tp) asks `tp is Generic`: an `int | None` read from a config's field is pinned by its type
    # only (a later call may bring another union), yet no union is ever the class Generic. A union against a union
    # stays unknown: that `is` is still a graph break.
    import types
    import typing
    from types import SimpleNamespace

    def f(x, field):
        tp = field.type
        if tp is typing.Generic:
            return x
        return x * (2 if typing.get_origin(tp) is types.UnionType else 3)

    compiled = kiln.compile(f)
    for field_type, factor in ((int | None, 2), (str | None, 2), (int, 3)):
        x = random_tensor(4)
        torch.testing.assert_close(compiled(x, SimpleNamespace(type=field_type)), x * factor)
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["frames_compiled"] == 2  # (int: a class, its own graph)


def test_a_mask_made_on_the_host_and_moved_to_the_device_compiles(device):
    # timm's EdgeNeXt positional encoding: `~torch.zeros(shape).to(device=device, dtype=torch.bool)`, then cumsums:
    # the host zeros fold into a device constant, and the graph runs on kiln's kernels on one device.
    def f(x):
        b, _, h, w = x.shape
        inv_mask = ~torch.zeros((b, h, w)).to(device=x.device, dtype=torch.bool)
        y_embed = inv_mask.cumsum(1, dtype=torch.float32)
        x_embed = inv_mask.cumsum(2, dtype=torch.float32)
        pos = torch.stack((y_embed / (y_embed[:, -1:, :] + 1e-6), x_embed.sin()), 1)
        return x + pos.sum(1, keepdim=True)

    compiled = kiln.compile(f)
    for _ in range(2):
        x = random_tensor(2, 3, 4, 5, device=device)
        torch.testing.assert_close(compiled(x), f(x))
    stats = kiln.stats()
    assert stats["graph_breaks"] == 0 and stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
