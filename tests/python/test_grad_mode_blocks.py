"""Grad-mode blocks (torch.no_grad / enable_grad / set_grad_enabled) in compiled code.

They are traced without a graph break: each switch is a kiln::set_grad_enabled node replayed in graph
order, so values, requires_grad and gradients match eager. A graph break inside such a block resumes
inside it, and an exception raised in the block leaves grad mode as eager's __exit__ would. Every case
is compared with eager (outputs, requires_grad, gradients) and asserts its number of graphs and breaks,
and that grad mode after the call equals eager's.
"""
import contextlib
import copy


import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

PRINTED = []


@kiln.disable
def record(*values):
    """An untraceable call (a graph break) whose effect the tests can see."""
    PRINTED.append(values)


class Boom(Exception):
    pass


@kiln.disable
def boom(*_):
    raise Boom("raised inside the block")


def requires_grad_of(out):
    if isinstance(out, torch.Tensor):
        return [out.requires_grad]
    return [t.requires_grad for t in out if isinstance(t, torch.Tensor)]


def check(fn, *args, graphs, breaks, fallbacks=0, calls=2, context=contextlib.nullcontext, grads=True, recompiles=0):
    """Compiled matches eager on `calls` calls (outputs, requires_grad, gradients, grad mode afterwards)
    under `context` at the call site; kiln.stats and kiln.explain report `graphs` graphs and `breaks` breaks."""
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(calls):
        with context():
            mode_before = torch.is_grad_enabled()
            expected = fn(*args)
            eager_mode_after = torch.is_grad_enabled()
            torch.set_grad_enabled(mode_before)
            # Gradients are compared where the call site has grad on (the helper's backward runs in `context`).
            out = assert_same_as_eager(fn, *args, compiled=compiled, grads=grads and mode_before)
            assert torch.is_grad_enabled() == eager_mode_after
            assert requires_grad_of(out) == requires_grad_of(expected)
            torch.set_grad_enabled(mode_before)
    stats = kiln.stats()
    assert stats["graph_breaks"] == breaks, stats
    assert stats["fallbacks"] == fallbacks, stats
    assert stats["recompiles"] == recompiles, stats  # pending __exit__s passed to resume code stay valid
    with context():
        result = kiln.explain(fn)(*args)
    assert result.graph_count == graphs, result
    assert result.graph_break_count == breaks + fallbacks, result
    return result


def weights(n=3):
    return random_tensor(n, requires_grad=True)


# --- traced without a break ------------------------------------------------------------------------

def no_grad_in_the_middle(x, w):
    h = x * w
    with torch.no_grad():
        scale = h.abs().amax() + 1  # a statistic: no gradient flows through it
    return (h / scale).exp() * 2 + 1


def test_no_grad_block_in_a_forward(fresh_kiln):
    result = check(no_grad_in_the_middle, random_tensor(4), weights(4), graphs=1, breaks=0)
    assert result.ops_per_graph[0].count("kiln::set_grad_enabled.default") == 2  # enter and exit


class TrainingBlock(nn.Module):
    """A training forward with a no_grad block in the middle (a running statistic, as in EMA/BN)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            centre = h.mean(dim=0, keepdim=True)
            detached = self.fc2(h)
        return self.fc2(h - centre) + detached


def test_training_forward_grads_flow_outside_the_block_only(fresh_kiln):
    torch.manual_seed(0)
    model = TrainingBlock()
    compiled = kiln.compile(model)
    for _ in range(2):
        out = assert_same_as_eager(model, random_tensor(5, 6, requires_grad=True), compiled=compiled)
        assert out.requires_grad
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["fallbacks"] == 0
    assert kiln.stats()["frames_compiled"] == 1
    # The block's work has no autograd history: the gradient is eager's, where `centre` is a constant.
    x = random_tensor(5, 6)
    compiled(x).sum().backward()
    kiln_grad = model.fc1.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(kiln_grad, model.fc1.weight.grad)


class Rotary(nn.Module):
    """A rotary embedding as transformers writes Llama's: a @torch.no_grad() forward over a buffer and positions."""

    def __init__(self, dim=8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    @torch.no_grad()
    def forward(self, x, positions):
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class RotaryBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rotary = Rotary()

    def forward(self, x, positions):
        q = self.proj(x)
        cos, sin = self.rotary(q, positions)
        rotated = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
        with torch.no_grad():
            scale = q.abs().amax() + 1  # reads a value that requires grad; no gradient flows through it
        return (q * cos + rotated * sin) / scale


def test_training_graph_with_no_grad_blocks_runs_on_compiled_autograd(fresh_kiln):
    """No_grad blocks in a training forward (Llama's rotary embedding) are differentiated as recorded: the values
    computed with grad off have no history, so no gradient flows through them. Before, any grad-mode switch sent the
    whole training graph to the op-by-op interpreter (Llama's step on CUDA ran eager's kernels)."""
    torch.manual_seed(0)
    model = RotaryBlock()
    compiled = kiln.compile(model)
    positions = torch.arange(6).expand(2, 6)
    for _ in range(2):
        assert_same_as_eager(model, random_tensor(2, 6, 8, requires_grad=True), positions, compiled=compiled)
    stats = kiln.stats()
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
    assert stats["graph_breaks"] == 0 and stats["frames_compiled"] == 1, stats


def clamps_a_weight_under_no_grad(x, w):
    with torch.no_grad():
        w.clamp_(-0.5, 0.5)  # an in-place update while grad is off: only the interpreter records it as eager does
    return (x * w).tanh()


def test_in_place_update_under_no_grad_keeps_the_interpreter(fresh_kiln):
    x = random_tensor(4, requires_grad=True)
    w_eager, w_kiln = weights(4), None
    w_kiln = w_eager.detach().clone().requires_grad_()
    expected = clamps_a_weight_under_no_grad(x, w_eager)
    actual = kiln.compile(clamps_a_weight_under_no_grad)(x, w_kiln)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(w_kiln, w_eager)
    (got,) = torch.autograd.grad(actual.sum(), w_kiln)
    (want,) = torch.autograd.grad(expected.sum(), w_eager)
    torch.testing.assert_close(got, want)
    assert "grad mode" in kiln.stats()["last_eager_interpreter_reason"]


class ActivationAverage(nn.Module):
    """Keeps an average of its activations in a buffer, updated in place under no_grad (VQ-VAE codebooks, EMA
    statistics); spectral norm's power iteration is the same pattern reached through torch's own code."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.avg.lerp_(y.mean(0), 0.1)
        return y - self.avg


def test_in_place_update_of_a_buffer_under_no_grad_is_compiled(fresh_kiln):
    torch.manual_seed(0)
    eager = ActivationAverage()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for _ in range(3):
        x = random_tensor(5, 4)
        want, got = eager(x), compiled(x)
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        for a, b in zip(mine.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        torch.testing.assert_close(mine.avg, eager.avg)
    stats = kiln.stats()
    assert stats["graphs_on_eager_interpreter"] == 0, stats["last_eager_interpreter_reason"]
    assert stats["frames_compiled"] == 1 and stats["graph_breaks"] == 0, stats


def enable_grad_inside(x, w):
    a = x * w  # no grad here: the caller runs under torch.no_grad
    with torch.enable_grad():
        b = (x * w).exp()
    return a, b


def test_enable_grad_inside_an_outer_no_grad_call(fresh_kiln):
    check(enable_grad_inside, random_tensor(3), weights(), graphs=1, breaks=0, context=torch.no_grad)
    kiln.reset()
    x, w_kiln, w_eager = random_tensor(3), weights(), None
    w_eager = w_kiln.detach().clone().requires_grad_(True)
    compiled = kiln.compile(enable_grad_inside)
    for _ in range(2):
        with torch.no_grad():
            a, b = compiled(x, w_kiln)
            ea, eb = enable_grad_inside(x, w_eager)
        assert not a.requires_grad and b.requires_grad and b.grad_fn is not None
        b.sum().backward()  # the gradient flows through the enable_grad block's ops only
        eb.sum().backward()
        torch.testing.assert_close(w_kiln.grad, w_eager.grad)


def set_grad_enabled_false(x, w):
    with torch.set_grad_enabled(False):
        frozen = x * w
    return frozen + x * w


def test_set_grad_enabled_false(fresh_kiln):
    check(set_grad_enabled_false, random_tensor(3), weights(), graphs=1, breaks=0)


def set_grad_enabled_flag(x, w, train):
    with torch.set_grad_enabled(train):
        y = (x * w).tanh()
    return y * 2


def test_set_grad_enabled_with_a_guarded_flag(fresh_kiln):
    compiled = kiln.compile(set_grad_enabled_flag)
    for train in (True, False, True, False):
        out = assert_same_as_eager(set_grad_enabled_flag, random_tensor(3), weights(), train, compiled=compiled)
        assert out.requires_grad == train
    stats = kiln.stats()
    assert stats["frames_compiled"] == 2 and stats["recompiles"] == 1, stats
    check(set_grad_enabled_flag, random_tensor(3), weights(), False, graphs=1, breaks=0)


def nested_blocks(x, w):
    a = x * w
    with torch.no_grad():
        b = a * 2
        with torch.enable_grad():
            c = a * 3
            with torch.no_grad():
                d = c + b
            e = c * d
        f = e + 1
    return a + f, b, c, d, e, f


def test_nested_blocks(fresh_kiln):
    check(nested_blocks, random_tensor(3), weights(), graphs=1, breaks=0)


def reads_grad_mode(x, w):
    with torch.no_grad():
        inside = torch.is_grad_enabled()
    y = x * w
    return y * 2 if inside else y * 3


def test_is_grad_enabled_is_a_trace_time_constant(fresh_kiln):
    check(reads_grad_mode, random_tensor(3), weights(), graphs=1, breaks=0)


@torch.no_grad()
def decorated_helper(h):
    return h * h.mean()


def calls_a_no_grad_function(x, w):
    h = x * w
    return h + decorated_helper(h)


def test_no_grad_as_a_decorator_of_an_inlined_function(fresh_kiln):
    check(calls_a_no_grad_function, random_tensor(3), weights(), graphs=1, breaks=0)


def return_inside_block(x, w):
    with torch.no_grad():
        return x * w


def test_return_inside_a_block(fresh_kiln):
    check(return_inside_block, random_tensor(3), weights(), graphs=1, breaks=0)


def no_grad_without_grad_inputs(x):
    y = x.exp()
    with torch.no_grad():
        z = y * 2 + 1
    return z.relu()


def test_kiln_backend_compiles_blocks_without_grad(fresh_kiln):
    check(no_grad_without_grad_inputs, random_tensor(16), graphs=1, breaks=0)


def test_call_site_inference_mode_is_guarded(fresh_kiln):
    compiled = kiln.compile(no_grad_in_the_middle)
    x, w = random_tensor(4), weights(4)
    assert_same_as_eager(no_grad_in_the_middle, x, w, compiled=compiled)
    with torch.inference_mode():
        out = compiled(x, w)
        expected = no_grad_in_the_middle(x, w)
        assert torch.is_grad_enabled() is False
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad and torch.is_inference(out) == torch.is_inference(expected)
    assert torch.is_grad_enabled()
    stats = kiln.stats()
    assert stats["frames_compiled"] == 2 and stats["recompiles"] == 1, stats
    check(no_grad_in_the_middle, x, w, graphs=1, breaks=0, context=torch.inference_mode)


def switches_mode_for_the_caller(x, w):
    y = x * w
    torch.set_grad_enabled(False)  # a statement, not a block: eager leaves grad off after the call
    return y + x * w


def test_a_statement_level_switch_outlives_the_call_as_in_eager(fresh_kiln):
    try:
        check(switches_mode_for_the_caller, random_tensor(3), weights(), graphs=1, breaks=0)
    finally:
        torch.set_grad_enabled(True)


# --- graph breaks and exceptions -------------------------------------------------------------------

def break_inside_no_grad(x, w):
    y = x * w
    with torch.no_grad():
        z = y * 2
        record("inside", torch.is_grad_enabled(), z.requires_grad)
        z = z + y
    return y + z, z


def test_break_inside_no_grad_resumes_inside_the_block(fresh_kiln):
    PRINTED.clear()
    check(break_inside_no_grad, random_tensor(3), weights(), graphs=2, breaks=1)
    assert PRINTED and all(p == ("inside", False, False) for p in PRINTED), PRINTED


def break_inside_nested(x, w):
    with torch.no_grad():
        a = x * w
        with torch.enable_grad():
            b = x * w
            record("nested", torch.is_grad_enabled())
            c = b * a
        d = c * 2
    return a, b, c, d


def test_break_inside_nested_blocks(fresh_kiln):
    PRINTED.clear()
    check(break_inside_nested, random_tensor(3), weights(), graphs=2, breaks=1)
    assert PRINTED and all(p == ("nested", True) for p in PRINTED), PRINTED


def helper_with_a_break(h):
    with torch.no_grad():
        s = h * 2
        record("helper", torch.is_grad_enabled())
        s = s + h
    return s


def calls_helper_with_a_break(x, w):
    h = x * w
    return h * helper_with_a_break(h)


def test_break_inside_a_block_of_an_inlined_function(fresh_kiln):
    PRINTED.clear()
    # The break moves to the caller's call; the helper then runs as its own frame, split inside its block:
    # caller before and after the call, helper before and after its break.
    check(calls_helper_with_a_break, random_tensor(3), weights(), graphs=4, breaks=2)
    assert PRINTED and all(p == ("helper", False) for p in PRINTED), PRINTED


def item_inside_no_grad(x, w):
    y = x * w
    with torch.no_grad():
        s = y.sum().item()
        z = y * s
    return y + z


def test_item_inside_no_grad(fresh_kiln):
    check(item_inside_no_grad, random_tensor(3), weights(), graphs=2, breaks=1)


def break_after_block(x, w):
    y = x * w
    with torch.no_grad():
        z = y * 2
    record("after", torch.is_grad_enabled())
    return y + z


def test_frame_with_a_with_statement_and_a_break_after_it(fresh_kiln):
    PRINTED.clear()
    check(break_after_block, random_tensor(3), weights(), graphs=2, breaks=1)
    assert PRINTED and all(p == ("after", True) for p in PRINTED), PRINTED


def break_before_block(x, w):
    y = x * w
    record("before")
    with torch.no_grad():
        z = y * 2
    return y + z


def test_break_before_a_block_traces_the_block_in_the_resume_function(fresh_kiln):
    check(break_before_block, random_tensor(3), weights(), graphs=2, breaks=1)


def raises_inside_no_grad(x, w):
    y = x * w
    with torch.no_grad():
        z = y * 2
        boom(z)
    return z


def raises_after_a_break(x, w, fail):
    y = x * w
    with torch.no_grad():
        z = y * 2
        record("before the raise")
        if fail:
            raise Boom("raised after the break")
        z = z + 1
    return z


def raises_in_nested_blocks(x, w):
    with torch.enable_grad():
        y = x * w
        with torch.no_grad():
            record("nested")
            boom(y)
    return y


@pytest.mark.parametrize("fn,args", [
    (raises_inside_no_grad, ()),
    (raises_after_a_break, (True,)),
    (raises_in_nested_blocks, ()),
], ids=["raise-at-the-break", "raise-after-a-break", "raise-in-nested-blocks"])
@pytest.mark.parametrize("caller_mode", [True, False])
def test_exception_inside_a_block_restores_the_mode(fresh_kiln, fn, args, caller_mode):
    compiled = kiln.compile(fn)
    for _ in range(2):
        with torch.set_grad_enabled(caller_mode):
            with pytest.raises(Boom):
                fn(random_tensor(3), weights(), *args)
            assert torch.is_grad_enabled() == caller_mode
            with pytest.raises(Boom):
                compiled(random_tensor(3), weights(), *args)
            assert torch.is_grad_enabled() == caller_mode
    assert kiln.stats()["fallbacks"] == 0, kiln.stats()
    assert kiln.stats()["graph_breaks"] >= 1, kiln.stats()


def test_raise_after_a_break_and_the_normal_path_share_the_code(fresh_kiln):
    compiled = kiln.compile(raises_after_a_break)
    for fail in (False, True, False, True):
        if fail:
            with pytest.raises(Boom):
                compiled(random_tensor(3), weights(), fail)
        else:
            assert_same_as_eager(raises_after_a_break, random_tensor(3), weights(), fail, compiled=compiled)
        assert torch.is_grad_enabled()


def graph_raises_inside_no_grad(x, index):
    y = x * 2
    with torch.no_grad():
        z = y.index_select(0, index)  # out of range: ATen raises while the graph runs
    return z


def test_a_graph_that_raises_inside_a_block_restores_the_mode(fresh_kiln):
    compiled = kiln.compile(graph_raises_inside_no_grad)
    good, bad = torch.tensor([0, 1]), torch.tensor([0, 50])
    assert_same_as_eager(graph_raises_inside_no_grad, random_tensor(3), good, compiled=compiled)
    for _ in range(2):
        with pytest.raises((IndexError, RuntimeError)):
            compiled(random_tensor(3), bad)
        assert torch.is_grad_enabled()
    assert kiln.stats()["frames_compiled"] == 1 and kiln.stats()["fallbacks"] == 0


# --- other context managers: a graph break, resumed inside the block (test_breaks_in_blocks.py) ----------



class UserContext:
    """A user context manager; its methods are kept out of kiln so that only the frame under test counts."""

    def __init__(self):
        self.entered = 0

    @kiln.disable
    def __enter__(self):
        self.entered += 1
        return self

    @kiln.disable
    def __exit__(self, *exc):
        return False


def user_context_manager(x, ctx):
    y = x * 2
    with ctx:
        z = y + 1
    return z


def test_user_context_manager_resumes_inside_its_block(fresh_kiln):
    ctx = UserContext()
    # Entering the block and calling __exit__ are breaks (both kiln.disable): three graphs.
    result = check(user_context_manager, random_tensor(3), ctx, graphs=3, breaks=2)
    assert result.breaks[0]["type"] == "with", result.breaks
    assert ctx.entered == 2 * 3 + 1  # check's three runs per call (two eager, one kiln), then explain's run


def break_inside_user_context(x, ctx):
    with ctx:
        y = x * 2
        record("user block")
    return y


def test_break_inside_a_user_context_manager_resumes_inside_its_block(fresh_kiln):
    check(break_inside_user_context, random_tensor(3), UserContext(), graphs=4, breaks=3)


# --- contextlib.nullcontext: what code enters where it might have entered autocast or no_grad ------------

def maybe_no_grad(enabled):
    """transformers' maybe_autocast pattern: a real manager or a nullcontext, chosen by a flag."""
    return torch.no_grad() if enabled else contextlib.nullcontext()


def null_blocks(x, w):
    with maybe_no_grad(False):
        h = x * w
    with contextlib.nullcontext(2.0) as scale:
        h = h * scale
    with maybe_no_grad(True):
        statistic = h.abs().amax()
    return h.sin() / (statistic + 1)


def test_null_context_blocks_are_traced_as_nothing(fresh_kiln):
    result = check(null_blocks, random_tensor(4), weights(4), graphs=1, breaks=0)
    assert result.ops_per_graph[0].count("kiln::set_grad_enabled.default") == 2  # only the no_grad block


def break_inside_a_null_block(x, w):
    with contextlib.nullcontext():
        y = x * w
        record("inside", torch.is_grad_enabled())
        z = y.exp()
    return y + z


def test_break_inside_a_null_context_resumes_inside_the_block(fresh_kiln):
    PRINTED.clear()
    check(break_inside_a_null_block, random_tensor(3), weights(), graphs=2, breaks=1)
    assert PRINTED and all(p == ("inside", True) for p in PRINTED), PRINTED
