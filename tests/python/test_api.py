"""kiln's user-facing API, checked against real behaviour: compile (function, decorator, module),
stats/reset, explain, disable, logs, backends, errors, fallbacks, tracebacks, generators, leaks."""
import fcntl
import gc
import inspect
import os
import pty
import struct
import subprocess
import sys
import termios
import traceback
import warnings

import numpy as np

import pytest
import torch
from torch import nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

# The folder holding the kiln package under test, for subprocesses.
KILN_PARENT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__)))
COUNTERS = ("frames_compiled", "cache_hits", "recompiles", "graph_breaks", "fallbacks")


def sin_plus(x, y):
    return torch.sin(x) + y


def line_of(fn, text):
    """The line number of the first line of fn's source that contains text."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# --- compile: the three call forms ------------------------------------------------------------

def test_decorator_without_parentheses(fresh_kiln):
    @kiln.compile
    def f(x):
        return torch.cos(x) * 2 + 1

    x = random_tensor(8)
    torch.testing.assert_close(f(x), torch.cos(x) * 2 + 1)
    assert kiln.stats()["frames_compiled"] == 1


def test_decorator_with_arguments(fresh_kiln):
    @kiln.compile()
    def f(x):
        return torch.cos(x) * 2 + 1

    @kiln.compile(mode="default", fullgraph=True)
    def g(x):
        return torch.tanh(x) - x

    x = random_tensor(8)
    torch.testing.assert_close(f(x), torch.cos(x) * 2 + 1)
    torch.testing.assert_close(g(x), torch.tanh(x) - x)
    assert kiln.stats()["frames_compiled"] == 2


def test_compile_function_call_form(fresh_kiln):
    compiled = kiln.compile(sin_plus)
    assert_same_as_eager(sin_plus, random_tensor(4, 5, requires_grad=True), random_tensor(4, 5), compiled=compiled)
    assert kiln.stats()["frames_compiled"] == 1


# --- mode, dynamic, options: each does what torch.compile's does, or raises ---------------------

@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_every_torch_compile_mode_is_accepted(fresh_kiln, mode):
    compiled = kiln.compile(sin_plus, mode=mode)
    assert_same_as_eager(sin_plus, random_tensor(4, 5, requires_grad=True), random_tensor(4, 5), compiled=compiled)


def test_unknown_mode_and_bad_dynamic_raise(fresh_kiln):
    with pytest.raises(kiln.errors.KilnError, match="unknown mode 'fast'"):
        kiln.compile(torch.sin, mode="fast")
    with pytest.raises(kiln.errors.KilnError, match="dynamic must be None, True or False"):
        kiln.compile(torch.sin, dynamic="yes")


def test_options_are_checked_against_the_known_keys(fresh_kiln):
    with pytest.raises(kiln.errors.KilnError, match="unknown option 'triton.cudagraphs'; known options: autotune, "
                                                    "cudagraphs, debug_dir"):
        kiln.compile(torch.sin, options={"triton.cudagraphs": True})
    with pytest.raises(kiln.errors.KilnError, match="option 'debug_dir' takes a str, got int"):
        kiln.compile(torch.sin, options={"debug_dir": 3})
    with pytest.raises(kiln.errors.KilnError, match="option 'autotune' takes a bool, got str"):
        kiln.compile(torch.sin, options={"autotune": "yes"})
    with pytest.raises(kiln.errors.KilnError, match="either mode or options"):
        kiln.compile(torch.sin, mode="default", options={"autotune": False})
    compiled = kiln.compile(sin_plus, options={"cudagraphs": False, "autotune": False})
    x, y = random_tensor(4), random_tensor(4)
    torch.testing.assert_close(compiled(x, y), sin_plus(x, y))


def test_debug_dir_option_keeps_this_compiles_graph_and_source(fresh_kiln, tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_DEBUG_DIR", raising=False)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    compiled = kiln.compile(sin_plus, options={"debug_dir": str(tmp_path)})
    x, y = random_tensor(4), random_tensor(4)
    torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
    kept = sorted(p.suffix for p in tmp_path.iterdir() if p.is_file())
    assert kept == [".cpp", ".txt"], kept
    source = next(tmp_path.glob("*.cpp")).read_text()
    assert "kernel" in source


def test_debug_dir_that_does_not_exist_yet_is_created(fresh_kiln, tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_DEBUG_DIR", raising=False)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "not" / "there"
    compiled = kiln.compile(sin_plus, options={"debug_dir": str(target)})
    x, y = random_tensor(5), random_tensor(5)
    torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
    assert sorted(p.suffix for p in target.iterdir()) == [".cpp", ".txt"]


def test_dynamic_true_compiles_once_for_every_size_and_disable_returns_the_model(fresh_kiln):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (dynamic=True is implemented: no warning)
        compiled = kiln.compile(sin_plus, dynamic=True)
    for n in (4, 7, 13):
        x, y = random_tensor(n), random_tensor(n)
        torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
    assert kiln.stats()["frames_compiled"] == 1, kiln.stats()
    assert kiln.compile(sin_plus, disable=True) is sin_plus


# --- modules ------------------------------------------------------------------------------------

def test_module_wrapper_shares_parameters_and_state_dict(fresh_kiln):
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    compiled = kiln.compile(model)
    assert list(compiled.state_dict().keys()) == list(model.state_dict().keys())
    for key, value in compiled.state_dict().items():
        assert value.data_ptr() == model.state_dict()[key].data_ptr(), f"{key} is a copy, not shared"
    assert compiled[0].weight is model[0].weight
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in model.parameters()]

    x = random_tensor(5, 6)
    assert_same_as_eager(model, x, compiled=compiled)
    assert kiln.stats()["frames_compiled"] >= 1, "calling the wrapper did not run compiled code"

    # Updates to the original's parameters reach the compiled module (no stale constants) ...
    with torch.no_grad():
        model[0].weight.mul_(-2)
    torch.testing.assert_close(compiled(x), model(x))
    # ... and loading a state dict through the wrapper updates the original.
    new_state = {key: random_tensor(value.shape) for key, value in model.state_dict().items()}
    compiled.load_state_dict(new_state)
    torch.testing.assert_close(model[2].bias, new_state["2.bias"])
    torch.testing.assert_close(compiled(x), model(x))


def test_module_attribute_access(fresh_kiln):
    model = nn.Linear(3, 2)
    compiled = kiln.compile(model)
    assert compiled.weight is model.weight
    assert compiled.bias is model.bias
    assert compiled.in_features == 3


# --- exceptions, generators ---------------------------------------------------------------------

def raises_after_tensor_ops(x):
    y = torch.cos(x) * 2
    raise ValueError(f"boom from user code {y.shape[0]}")


def helper_that_raises(x):
    if x.dim() > 0:
        raise KeyError("inner helper failed")
    return x


def calls_raising_helper(x):
    y = x + 1
    return helper_that_raises(y)


def user_frames(exc):
    return [(frame.name, frame.lineno) for frame in traceback.extract_tb(exc.__traceback__)]


def test_exception_keeps_user_traceback(fresh_kiln):
    compiled = kiln.compile(raises_after_tensor_ops)
    with pytest.raises(ValueError, match="boom from user code 4") as info:
        compiled(random_tensor(4))
    frames = user_frames(info.value)
    assert (raises_after_tensor_ops.__name__, line_of(raises_after_tensor_ops, "raise ValueError")) in frames, frames


def test_exception_from_called_helper_keeps_both_frames(fresh_kiln):
    compiled = kiln.compile(calls_raising_helper)
    with pytest.raises(KeyError, match="inner helper failed") as info:
        compiled(random_tensor(3))
    frames = user_frames(info.value)
    names = [name for name, _ in frames]
    assert "calls_raising_helper" in names, frames
    assert frames[-1] == ("helper_that_raises", line_of(helper_that_raises, "raise KeyError")), frames


def scaled_terms(x, count):
    for i in range(count):
        yield x * (i + 1)


def sums_a_generator(x):
    total = torch.zeros_like(x)
    for term in scaled_terms(x, 3):
        total = total + term
    return total, list(scaled_terms(x.cos(), 2))


def test_generator_called_from_compiled_function(fresh_kiln):
    out = assert_same_as_eager(sums_a_generator, random_tensor(6, requires_grad=True))
    assert len(out[1]) == 2


# --- no leaks -------------------------------------------------------------------------------------

def call_many(compiled, x, times):
    out = None
    for _ in range(times):
        out = compiled(x)
    return out


@pytest.mark.parametrize("kind", ["function", "module"])
def test_thousand_calls_leak_nothing(fresh_kiln, kind):
    if kind == "module":
        target = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        x = random_tensor(4, 16)
    else:
        def target(t):
            return torch.sin(t) * 2 + 1
        x = random_tensor(8)
    compiled = kiln.compile(target)
    call_many(compiled, x, 5)  # compile and settle caches first
    gc.collect()
    refs_x, refs_target = sys.getrefcount(x), sys.getrefcount(target)
    objects = len(gc.get_objects())

    call_many(compiled, x, 1000)
    gc.collect()
    assert sys.getrefcount(x) == refs_x, "the input tensor leaked references"
    assert sys.getrefcount(target) == refs_target, "the compiled module/function leaked references"
    grown = len(gc.get_objects()) - objects
    assert grown < 50, f"{grown} more gc-tracked objects after 1000 calls"
    assert kiln.stats()["cache_hits"] >= 1000


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.inner(x)) * 2)


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_deleted_model_is_freed_and_its_entries_dropped(fresh_kiln, compiled_autograd):
    """Cache entries live on the class's code object; they must not keep a deleted model (its submodules,
    parameters, the compiled wrapper's class) alive, and a new model of the class must not find them."""
    import weakref

    kiln.config.set_compiled_autograd(compiled_autograd)
    try:
        model = TwoLayers()
        compiled = kiln.compile(model)
        x = random_tensor(8, 16)
        compiled(x).sum().backward()
        with torch.no_grad():
            compiled(x)
        alive = [weakref.ref(o) for o in (model, model.inner, model.inner.weight, type(compiled))]
        assert len(kiln._C.cache_entries(TwoLayers.forward.__code__)) == 2  # with grad and without
        del model, compiled
        gc.collect()
        assert [r() is None for r in alive] == [True] * 4
        # A new instance compiles afresh; the freed model's entries are dropped on that miss.
        fresh = TwoLayers()
        assert_same_as_eager(fresh, random_tensor(8, 16, requires_grad=True))
        assert len(kiln._C.cache_entries(TwoLayers.forward.__code__)) == 1
    finally:
        kiln.config.set_compiled_autograd(False)


def test_compiled_module_deep_copies_and_pickles_as_the_plain_module(fresh_kiln):
    import copy
    import pickle

    model = TwoLayers()
    compiled = kiln.compile(model)
    x = random_tensor(8, 16)
    for twin in (copy.deepcopy(compiled), pickle.loads(pickle.dumps(compiled))):
        assert type(twin) is TwoLayers
        assert twin.inner.weight is not model.inner.weight
        torch.testing.assert_close(twin(x), model(x))


class Named(nn.Module):
    """Reads its own class inside forward, as model code does (type(self).__name__, class-keyed registries)."""
    scale_of_class = {}

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    @classmethod
    def name_length(cls):
        return len(cls.__name__)

    def forward(self, x):
        scale = Named.scale_of_class.get(type(self), 0.0) + len(self.__class__.__name__) + type(self).name_length()
        return self.linear(x) * scale


Named.scale_of_class[Named] = 3.0


def test_compiled_module_is_invisible_to_the_modules_own_code(fresh_kiln):
    """Regression: forward ran with `self` an instance of kiln's wrapper class (CompiledNamed), so type(self),
    self.__class__ and class-keyed lookups differed from eager and so did the output."""
    model = Named()
    compiled = kiln.compile(model)
    assert isinstance(compiled, Named)
    for _ in range(2):
        assert_same_as_eager(model, random_tensor(2, 4, requires_grad=True), compiled=compiled)
    assert compiled.state_dict().keys() == model.state_dict().keys()
    compiled.eval()
    assert not model.training
    again = kiln.compile(compiled)  # compiling a compiled module compiles the original
    torch.testing.assert_close(again(torch.ones(1, 4)), model(torch.ones(1, 4)))


# --- stats, reset, explain, disable ------------------------------------------------------------

def test_stats_counters_and_reset(fresh_kiln):
    stats = kiln.stats()
    assert {key: stats[key] for key in COUNTERS} == dict.fromkeys(COUNTERS, 0)
    compiled = kiln.compile(sin_plus)
    x, y = random_tensor(3), random_tensor(3)
    compiled(x, y)
    compiled(x, y)
    assert kiln.stats()["frames_compiled"] == 1
    assert kiln.stats()["cache_hits"] == 1

    kiln.reset()
    assert {key: kiln.stats()[key] for key in COUNTERS} == dict.fromkeys(COUNTERS, 0)
    torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
    assert kiln.stats()["frames_compiled"] == 1, "after reset the next call must compile again"
    assert kiln.stats()["cache_hits"] == 0


def test_stats_count_graphs_on_the_eager_interpreter(fresh_kiln):
    """A captured graph the compiler cannot lower (here an in-place op on an intermediate a view reads) runs on
    kiln's eager interpreter: no graph break and no frame fallback, so kiln.stats() says so with its own counter."""
    def viewed_in_place(x):
        y = x * 2
        flat = y.view(-1)
        y.relu_()  # flat sees it
        return flat + 0

    x = random_tensor(4, 4)
    torch.testing.assert_close(kiln.compile(viewed_in_place)(x), viewed_in_place(x))
    stats = kiln.stats()
    assert stats["graph_breaks"] == 0 and stats["fallbacks"] == 0, stats
    assert stats["graphs_on_eager_interpreter"] == 1, stats
    assert "in-place" in stats["last_eager_interpreter_reason"], stats
    kiln.reset()
    assert kiln.stats()["graphs_on_eager_interpreter"] == 0 and kiln.stats()["last_eager_interpreter_reason"] == ""
    torch.testing.assert_close(kiln.compile(sin_plus)(x, x), sin_plus(x, x))
    assert kiln.stats()["graphs_on_eager_interpreter"] == 0


def test_explain_single_graph(fresh_kiln):
    result = kiln.explain(sin_plus)(random_tensor(4, 4), random_tensor(4, 4))
    assert result.graph_count == 1
    assert result.graph_break_count == 0
    assert list(result.break_reasons) == []
    assert len(result.ops_per_graph) == 1
    ops = list(result.ops_per_graph[0])
    assert "aten::add.Tensor" in ops, ops
    assert any(op.startswith("aten::sin") for op in ops), ops
    assert all(op.startswith("aten::") for op in ops), ops
    assert result.guards and all(isinstance(guard, str) for guard in result.guards)
    assert any("x" in guard for guard in result.guards), result.guards


@kiln.disable
def opaque_scale(t):
    return t * 3


def breaks_at_disabled_call(x):
    y = torch.sin(x)
    z = opaque_scale(y)
    return torch.cos(z)


def test_explain_graph_break_at_disabled_function(fresh_kiln):
    x = random_tensor(5)
    result = kiln.explain(breaks_at_disabled_call)(x)
    assert result.graph_break_count == 1, result.break_reasons
    # The frame splits at the call: sin before it, cos in the resume function.
    assert result.graph_count == 2
    assert "kiln.disable" in result.break_reasons[0]
    assert "test_api.py" in result.break_reasons[0]
    # The break changes nothing about the answer.
    assert_same_as_eager(breaks_at_disabled_call, random_tensor(5, requires_grad=True))


def test_disabled_function_runs_eagerly(fresh_kiln):
    assert_same_as_eager(opaque_scale, random_tensor(5), compiled=kiln.compile(opaque_scale))
    assert kiln.stats()["frames_compiled"] == 0


def test_fullgraph_turns_a_break_into_an_error(fresh_kiln):
    compiled = kiln.compile(breaks_at_disabled_call, fullgraph=True)
    with pytest.raises(kiln.errors.GraphBreakError) as info:
        compiled(random_tensor(3))
    assert os.path.basename(__file__) in str(info.value), str(info.value)


# --- logs -------------------------------------------------------------------------------------------

LOG_SCRIPT = """
import torch, kiln
@kiln.compile
def f(x):
    return x.sin() + 1
f(torch.randn(4)); f(torch.randn(4)); f(torch.randn(4, dtype=torch.float64))
"""


def log_env(logs, cache_dir=None):
    env = dict(os.environ, PYTHONPATH=KILN_PARENT_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cache_dir is not None:
        env["KILN_CACHE_DIR"] = str(cache_dir)
    env.pop("KILN_LOGS", None)
    if logs is not None:
        env["KILN_LOGS"] = logs
    return env


def run_with_logs(logs, cache_dir=None, script=LOG_SCRIPT):
    """The script's stderr, run in a new process with KILN_LOGS=logs (None: unset); stderr is a pipe, no terminal."""
    proc = subprocess.run([sys.executable, "-c", script], env=log_env(logs, cache_dir), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_kiln_logs_print_graph_guards_recompiles():
    stderr = run_with_logs("graph,guards,recompiles")
    lines = stderr.splitlines()
    for category in ("graph", "guards", "recompiles"):
        assert any(line.startswith(f"[kiln:{category}]") for line in lines), f"no [kiln:{category}] line:\n{stderr}"
    assert "aten::sin" in stderr, stderr
    # Without KILN_LOGS kiln is silent.
    assert "[kiln:" not in run_with_logs(None)


def test_kiln_logs_passes_prints_the_graph_after_each_pass(tmp_path):
    stderr = run_with_logs("passes", cache_dir=tmp_path)
    names = [line.split("after ", 1)[1].split(":")[0] for line in stderr.splitlines()
             if line.startswith("[kiln:passes] after ")]
    # the pipeline's passes in order, for each of the two graphs (float32, then float64)
    order = ["lower_inference_batch_norm", "lower_cross_entropy", "attention_masks_as_biases",
             "sink_pointwise_into_copies", "stage_row_sums",
             "relayout_convolutions_channels_last", "simplify_algebra", "eliminate_common_subexpressions",
             "remove_dead_nodes", "fuse_recomputation"]
    assert names == order * 2, stderr
    assert "aten::sin" in stderr, stderr


def test_kiln_logs_perf_times_each_compile(tmp_path):
    # one line per compiled frame (trace and backend times) and one per kiln-backend graph (its phases)
    stderr = run_with_logs("perf", cache_dir=tmp_path)
    compiled = [line for line in stderr.splitlines() if line.startswith("[kiln:perf] compiled ")]
    assert len(compiled) == 2, stderr  # the float32 entry, then the float64 recompile
    assert all(" ms: trace " in line and "(2 ops)" in line and "backend 'kiln'" in line for line in compiled), stderr
    assert "<string>:3" in compiled[0], compiled[0]  # f's file:line
    phases = [line for line in stderr.splitlines() if line.startswith("[kiln:perf] kiln backend: 1 kernels, 0 extern")]
    assert len(phases) == 2 and all("code generation" in line and "compiler or cache" in line for line in phases), stderr
    # a new process finds both graphs whole in the cache: no passes, code generation or compiler
    stderr = run_with_logs("perf", cache_dir=tmp_path)
    found = [line for line in stderr.splitlines() if line.startswith("[kiln:perf] kiln backend: found in the graph cache")]
    assert len(found) == 2 and "code generation" not in stderr, stderr


# A function compiled as a forward and a backward half; `after` is kiln.config.progress_after_s (0: shown at once).
PROGRESS_SCRIPT = """
import torch, kiln
kiln.config.progress_after_s = {after}
w = torch.randn(4, requires_grad=True)
@kiln.compile
def g(x):
    return (x * w).sin().sum()
g(torch.randn(4)).backward()
"""


def test_kiln_logs_progress_lists_the_stages_of_a_slow_compile(tmp_path):
    stderr = run_with_logs("progress", cache_dir=tmp_path, script=PROGRESS_SCRIPT.format(after=0))
    lines = [line[len("[kiln:progress] "):] for line in stderr.splitlines() if line.startswith("[kiln:progress] ")]
    # "<graph>: <stage>, <seconds> s"; each half goes through the lowering, and the empty cache makes the system C++
    # compiler run for both
    graph = "graph 1, g (<string>:5)"
    compiler = os.path.basename(os.environ.get("CXX") or "c++")
    lowering = ["passes", "fusion", "codegen", f"compile C++ ({compiler})", "load"]
    expected = ([f"{graph}: {stage}" for stage in ("trace", "passes", "autodiff")] +
                [f"{graph}, forward half: {stage}" for stage in lowering] +
                [f"{graph}, backward half: {stage}" for stage in lowering])
    assert [line.rsplit(", ", 1)[0] for line in lines[:-1]] == expected, stderr
    assert lines[-1].startswith(f"{graph}: done in "), stderr
    # with the threshold far away, a compile this fast shows nothing
    assert "[kiln:progress]" not in run_with_logs("progress", script=PROGRESS_SCRIPT.format(after=60))


def test_progress_is_silent_without_a_terminal_or_kiln_logs(tmp_path):
    assert run_with_logs(None, cache_dir=tmp_path, script=PROGRESS_SCRIPT.format(after=0)) == ""


def test_progress_on_a_terminal_is_one_line_rewritten_then_cleared(tmp_path):
    controller, terminal = pty.openpty()
    # 200 columns: wide enough for the whole line (a narrower terminal gets the name shortened)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", PROGRESS_SCRIPT.format(after=0)], env=log_env(None, tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    written = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        written += chunk
    os.close(controller)
    assert proc.wait(timeout=600) == 0, written
    text = written.decode()
    assert "\n" not in text.replace("\r\n", ""), text  # no new lines: one line, rewritten
    assert text.startswith("\r[kiln] compiling graph 1, g (<string>:5): trace... ") and text.endswith("\r\x1b[K"), text
    assert "backward half: compile C++ (" in text, text
    assert run_with_logs(None, cache_dir=tmp_path, script=PROGRESS_SCRIPT.format(after=None)) == ""


# --- backends -----------------------------------------------------------------------------------

def test_eager_backend(fresh_kiln):
    compiled = kiln.compile(sin_plus, backend="eager")
    assert_same_as_eager(sin_plus, random_tensor(3, 4, requires_grad=True), random_tensor(3, 4), compiled=compiled)
    assert kiln.stats()["frames_compiled"] == 1


def test_user_backend_callable_is_used(fresh_kiln):
    received = []
    calls = []

    # The backend contract: backend(graph, example_inputs: list[Tensor]) -> callable(list[Tensor]) -> outputs.
    # This one delegates the actual work to the built-in eager backend and counts its calls.
    def counting_backend(graph, example_inputs):
        received.append((str(graph), list(example_inputs)))
        run_eagerly = kiln._C.compile_graph(graph, "eager")

        def run(inputs):
            calls.append(len(inputs))
            return run_eagerly(inputs)
        return run

    compiled = kiln.compile(sin_plus, backend=counting_backend)
    x, y = random_tensor(3, 4), random_tensor(3, 4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
    assert len(received) == 1, "the backend should compile the graph once"
    graph_text, example_inputs = received[0]
    assert "aten::" in graph_text, graph_text
    assert any(isinstance(t, torch.Tensor) and t.shape == x.shape for t in example_inputs), example_inputs
    assert len(calls) == 3, f"the backend's callable ran {len(calls)} times for 3 calls"


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_garbage_collector_is_paused_while_a_frame_compiles(fresh_kiln, enabled_before):
    # Tracing allocates many short-lived objects; a collection walks all of torch's heap (compile_frame.cpp).
    # A backend runs inside the compile: it sees the collector off. Afterwards it is as the caller left it.
    seen = []

    def backend(graph, example_inputs):
        seen.append(gc.isenabled())
        return kiln._C.compile_graph(graph, "eager")

    was = gc.isenabled()
    try:
        gc.enable() if enabled_before else gc.disable()
        compiled = kiln.compile(sin_plus, backend=backend)
        x, y = random_tensor(3, 4), random_tensor(3, 4)
        torch.testing.assert_close(compiled(x, y), sin_plus(x, y))
        assert seen == [False]
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable() if was else gc.disable()


def test_unknown_backend_names_the_known_ones(fresh_kiln):
    with pytest.raises(kiln.errors.KilnError) as info:
        kiln.compile(sin_plus, backend="no_such_backend")(random_tensor(2), random_tensor(2))
    message = str(info.value)
    assert "no_such_backend" in message
    assert "eager" in message and "kiln" in message, message


# --- fallback -------------------------------------------------------------------------------------

def through_numpy(x):
    return torch.from_numpy(np.sin(x.numpy()) * 2) + 1


def test_untraceable_frame_falls_back_to_eager(fresh_kiln):
    x = random_tensor(7)
    out = kiln.compile(through_numpy)(x)
    torch.testing.assert_close(out, through_numpy(x))
    assert kiln.stats()["fallbacks"] + kiln.stats()["graph_breaks"] >= 1, kiln.stats()


def test_mark_dynamic_and_mark_static_take_torch_compiles_arguments(fresh_kiln):
    x = random_tensor(4, 6, 8)
    kiln.mark_dynamic(x, [0, -1], min=2, max=64)
    assert x._kiln_dynamic_dims == {0: (2, 64), 2: (2, 64)}
    kiln.mark_static(x, 2)
    assert x._kiln_dynamic_dims == {0: (2, 64)} and x._kiln_static_dims == {2}
    kiln.mark_static(x)
    assert x._kiln_dynamic_dims == {} and x._kiln_static_dims == {0, 1, 2}
    for bad, message in (((x, 3), "dimension 3 out of range"), ((x, 0, 8, 4), "min 8 is larger than max 4"),
                         (("x", 0), "expects a tensor")):
        with pytest.raises(kiln.errors.KilnError, match=message):
            kiln.mark_dynamic(*bad[:2], **dict(zip(("min", "max"), bad[2:])))
    # Every dim marked static: one specialised graph, as without marks.
    torch.testing.assert_close(kiln.compile(sin_plus)(x, x), sin_plus(x, x))
