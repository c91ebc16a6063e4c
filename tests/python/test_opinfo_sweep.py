"""The OpInfo sweep (issues 4 and 5): PyTorch's op_db compiled by the "kiln" backend, against eager, on CPU
samples (and on CUDA samples where a GPU is present).

For each op and dtype of SWEEP_DTYPES that the op supports, one sample (seeded, the first with more than one
element) is called through `kiln.compile(fn, backend="kiln")` and compared with eager: same structure,
dtypes, shapes, NaN positions, values within kiln.testing's "general" tolerance. Each op is classified:

  generated  at least one of its nodes ran in a generated (C++/OpenMP) kernel
  extern     the graph compiled, but all of the op's nodes ran as ATen calls (or it had none)
  fallback   the graph ran on the eager interpreter, or the trace broke / made no single graph

Skipped, and counted as such: ops whose eager call raises, in-place variants, ops whose outputs are not
all tensors (item, allclose, ...). Random ops and ops returning uninitialised memory (empty*) are compared
by structure, dtype and shape only. op_db wraps its random ops in torch.testing's wrapper_set_seed (a
contextlib context manager that reseeds and restores the RNG for PyTorch's own tests); the sweep replaces it
by a plain call, so that it measures the op rather than that harness, and decides determinism by running the
op under several seeds (dropout with p=0 and attention without dropout are still compared by value).

Cost: every generated graph is one run of the C++ compiler (~1 s here), so ops are compiled in *batches*:
one generated function calls the ops of up to BATCH_SIZE cases, each on its own input tensors, and returns
all their results. One compile covers the batch; results are compared per op. Classification stays per op:
the batch graph is captured, compiled with kiln._C.compile_graph under a fresh KILN_DEBUG_DIR (which keeps
the optimised graph), and every node named by a kernel's "covers graph nodes" comment is attributed to the
ops whose input tensors it depends on. A batch that falls back or raises is bisected down to the op
responsible; when the fallback reason names an op, the cases whose graphs hold it are taken out at once.
Ops that break the graph (or take no tensor) are compiled alone.

The test fails on any mismatch or kiln error, and asserts a floor on generated+extern coverage.
`pytest -s` prints the report (counts and the class of every op).
"""
import glob
import os
import re
import tempfile
import time

import pytest
import torch
from torch.utils import _pytree as pytree

try:
    import expecttest  # noqa: F401  (torch.testing._internal needs it)
except ImportError:
    # The GPU machine has no package index. op_db only needs expecttest's TestCase base class and its ACCEPT
    # flag (for torch's own expect-file tests, which the sweep never runs): a stand-in module provides both.
    import sys
    import types
    import unittest

    expecttest = types.ModuleType("expecttest")
    expecttest.TestCase = unittest.TestCase
    expecttest.ACCEPT = False
    sys.modules["expecttest"] = expecttest

import kiln
from kiln.testing import capture_graphs, tolerance

SWEEP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool)
BATCH_SIZE = 48
# Generated+extern share of the ops eager supports, per dtype, as measured (issue 4 aims at 0.90). CPU,
# 2026-11-22: float32 597/654, float64 597/654, bfloat16 483/530, int64 417/446, bool 317/331; the rest are graph
# breaks and graphs with in-place ops (see the report's fallback lines). CUDA (H200), 2026-11-22: float32 571/652,
# float64 571/652, bfloat16 464/531, int64 374/422, bool 310/335, 0 mismatches; H100, 2026-11-26: float32 and float64
# 88.5%, bfloat16 88.7%, int64 89.3%, bool 93.4%, 0 mismatches.
COVERAGE_FLOOR = {
    "cpu": {torch.float32: 0.91, torch.float64: 0.91, torch.bfloat16: 0.91, torch.int64: 0.93, torch.bool: 0.95},
    "cuda": {torch.float32: 0.88, torch.float64: 0.88, torch.bfloat16: 0.88, torch.int64: 0.89, torch.bool: 0.93},
}

# Mismatches whose cause lies outside the compiler (the tracer and runtime own them), each a predicate over
# (case, message). They are listed in the report; any other mismatch fails the test.
KNOWN_ISSUES = {}

# Ops op_db marks as seeded (their function calls wrapper_set_seed) are run under this many more seeds before
# their values count as deterministic: a small sample of bernoulli or multinomial can repeat under two seeds.
SEEDED_RERUNS = 4


def seeded_by_op_db(op):
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted")
# Results whose values eager leaves unspecified: the fused attention kernels' philox seed and offset outputs are
# not written without dropout (an H200 returned different garbage for eager and kiln); compared by dtype and
# shape only.
UNSPECIFIED_RESULTS = {"_flash_attention_forward": (2, 3), "_efficient_attention_forward": (2, 3)}


@pytest.fixture(scope="module", autouse=True)
def kiln_cache_dir(tmp_path_factory):
    # A cold cache per session: the sweep's cost is measured as CI sees it.
    cache = tmp_path_factory.mktemp("kiln_cache_opinfo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(cache))
        yield str(cache)


@pytest.fixture(scope="module", autouse=True)
def ops_without_seed_wrapper():
    # op_db wraps its random ops (dropout, normal, bernoulli, rrelu, ...) in torch.testing's wrapper_set_seed,
    # which reseeds and restores the RNG state through a contextlib context manager so that PyTorch's own tests
    # get reproducible numbers. The sweep measures the ops, not that harness: random results are compared by
    # dtype and shape (their values differ between two eager calls), deterministic ones by value. The lambdas
    # of op_db read the name from their module's globals at call time, so replacing it there unwraps them all.
    from torch.testing._internal import common_methods_invocations as op_db_module
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(op_db_module, "wrapper_set_seed", lambda op, *args, **kwargs: op(*args, **kwargs))
        yield


# ---- one case: an op, a dtype, one sample ------------------------------------------------------------------
class Case:
    def __init__(self, op, dtype, sample):
        self.op = op
        self.key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        self.dtype = dtype
        # The call as a tree (input, args, kwargs) whose tensor leaves become parameters of the compiled function.
        self.tree = ((sample.input,) + tuple(sample.args), dict(sample.kwargs))
        leaves, self.spec = pytree.tree_flatten(self.tree)
        self.tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.expected = None
        self.values_comparable = True  # False for random ops and uninitialised memory
        self.kind = None      # generated | extern | fallback
        self.reason = ""
        self.graph_ops = []   # op overloads of its graph when traced alone

    def call(self):
        args, kwargs = self.tree
        return self.op.op(*args, **kwargs)


def first_sample(op, dtype, device):
    torch.manual_seed(0)
    chosen = None
    for sample in op.sample_inputs(device, dtype, requires_grad=False):
        if chosen is None:
            chosen = sample
        if isinstance(sample.input, torch.Tensor) and sample.input.numel() > 1:
            return sample
        if not isinstance(sample.input, torch.Tensor):
            break
    return chosen


def tensors_only(result):
    leaves = pytree.tree_leaves(result)
    return all(isinstance(x, torch.Tensor) and x.layout == torch.strided for x in leaves) and len(leaves) > 0


def same_result(a, b):
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        return True
    except Exception:
        return False


def sweep_ops(skipped, supported):
    """(key, op) of every op of op_db that `supported(op)` accepts, in-place variants recorded in `skipped`."""
    from torch.testing._internal.common_methods_invocations import op_db
    for op in op_db:
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        if not supported(op):
            continue
        if op.name.endswith("_") or "inplace" in op.variant_test_name or "in_place" in op.variant_test_name:
            skipped[key] = "in-place variant"
            continue
        yield key, op


def collect_cases(dtype, skipped, device="cpu"):
    """The cases of `dtype`: ops whose eager call on their sample succeeds and returns tensors."""
    cases = []
    for key, op in sweep_ops(skipped, lambda op: dtype in op.supported_dtypes(device)):
        try:
            sample = first_sample(op, dtype, device)
            if sample is None:
                skipped[key] = "no sample"
                continue
            case = Case(op, dtype, sample)
            with torch.no_grad():
                torch.manual_seed(1)
                expected = case.call()
                if not tensors_only(expected):
                    skipped[key] = "non-tensor (or sparse) output"
                    continue
                # A copy: ops such as cauchy_ return their input, which later calls overwrite.
                expected = pytree.tree_map(torch.clone, expected)
                reruns = 1 + (SEEDED_RERUNS if seeded_by_op_db(op) else 0)
                deterministic = True
                for seed in range(2, 2 + reruns):
                    torch.manual_seed(seed)
                    deterministic = deterministic and same_result(expected, case.call())
        except Exception as e:
            skipped[key] = f"eager raises {type(e).__name__}"
            continue
        case.expected = expected
        case.values_comparable = op.name.split(".")[-1] not in UNINITIALISED and deterministic
        cases.append(case)
    return cases


# ---- generated batch functions -----------------------------------------------------------------------------
def make_batch_function(cases):
    """def batch(t0, t1, ...): return (op0(t0, c0, dim=c1), op1(t2, t3), ...), built as source text so the
    tracer sees plain calls with tensors as parameters and every other value as a global."""
    params, constants, calls, tensors = [], {}, [], []

    def render(x):
        if isinstance(x, torch.Tensor):
            name = f"t{len(params)}"
            params.append(name)
            tensors.append(x)
            return name
        if type(x) in (list, tuple) and any(isinstance(y, torch.Tensor) for y in pytree.tree_leaves(x)):
            items = [render(y) for y in x]
            return "[" + ", ".join(items) + "]" if type(x) is list else "(" + "".join(i + ", " for i in items) + ")"
        name = f"c{len(constants)}"
        constants[name] = x
        return name

    for i, case in enumerate(cases):
        args, kwargs = case.tree
        constants[f"op{i}"] = case.op.op
        rendered = [render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()]
        calls.append(f"op{i}({', '.join(rendered)})")
    source = f"def batch({', '.join(params)}):\n    return ({''.join(c + ', ' for c in calls)})\n"
    namespace = dict(constants)
    exec(compile(source, f"<opinfo batch {cases[0].key}>", "exec"), namespace)
    owner = []  # per parameter: the index of the case it belongs to
    for i, case in enumerate(cases):
        owner += [i] * len(case.tensors)
    return namespace["batch"], tensors, owner


def capture(fn, tensors):
    return capture_graphs(fn, *tensors)


# ---- attributing kernels to ops ----------------------------------------------------------------------------
NODE_LINE = re.compile(r"^  (.*?) = ([\w:.]+)\((.*)\)(  # list)?$")
VALUE_ID = re.compile(r"%(\d+)")
KERNEL_COVERS = re.compile(r"^// (kernel_\w+) covers graph nodes:(.*)$", re.M)


def kernel_node_owners(graph_text, source, input_owner):
    """The set of case indices whose nodes run in generated kernels. `graph_text` is the optimised graph
    (Graph.to_string), `input_owner` the case index of each graph input."""
    lines = graph_text.splitlines()
    header = lines[0]
    owners = {}
    inputs = [int(v) for v in re.findall(r"%(\d+) :", header)]
    for position, value in enumerate(inputs):
        owners[value] = {input_owner[position]}
    node_owners = []
    for line in lines[1:]:
        m = NODE_LINE.match(line)
        if not m or m.group(2) == "constant":
            continue
        outs = [int(v) for v in re.findall(r"%(\d+) :", m.group(1))]
        mine = set()
        for v in VALUE_ID.findall(m.group(3)):
            mine |= owners.get(int(v), set())
        for v in outs:
            owners[v] = mine
        node_owners.append((m.group(2), mine))
    covered = set()
    for _, nodes in KERNEL_COVERS.findall(source):
        for item in nodes.split():
            index, name = item.split(":", 1)
            op_name, mine = node_owners[int(index)]
            assert op_name == name, (op_name, name)
            covered |= mine
    return covered


# ---- running a batch ---------------------------------------------------------------------------------------
def compare(case, actual):
    expected = case.expected
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        return f"{len(act_leaves)} results, eager gives {len(exp_leaves)}"
    for i, (a, e) in enumerate(zip(act_leaves, exp_leaves)):
        if not isinstance(a, torch.Tensor):
            return f"result {i} is a {type(a).__name__}, eager gives a tensor"
        if a.dtype != e.dtype or a.shape != e.shape:
            return f"result {i}: {a.dtype}{list(a.shape)}, eager {e.dtype}{list(e.shape)}"
        if not case.values_comparable or i in UNSPECIFIED_RESULTS.get(case.op.name.split(".")[-1], ()):
            continue
        rtol, atol = tolerance(e.dtype, "general")
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            return f"result {i}: " + " ".join(str(err).split())[:300]
    return ""


class Sweep:
    def __init__(self):
        self.failures = []   # (case, message)
        self.compiles = 0

    def run_alone(self, case, reason):
        """A case that breaks the graph (or has no tensor): checked end to end, classified as fallback
        unless it traced into one graph."""
        case.kind, case.reason = "fallback", reason
        self.check_end_to_end([case])

    def check_end_to_end(self, cases):
        """kiln.compile(fn, backend="kiln") on the batch; returns False if kiln raised."""
        fn, tensors, _ = make_batch_function(cases)
        kiln.reset()
        try:
            with torch.no_grad():
                results = kiln.compile(fn, backend="kiln")(*tensors)
        except Exception as e:
            if len(cases) == 1:
                self.failures.append((cases[0], f"kiln raised {type(e).__name__}: {str(e)[:300]}"))
            return False
        finally:
            kiln.reset()
        for case, actual in zip(cases, results):
            message = compare(case, actual)
            if message:
                self.failures.append((case, message))
        return True

    def run_batch(self, cases, depth=0):
        fn, tensors, owner = make_batch_function(cases)
        try:
            graphs, breaks = capture(fn, tensors)
        except Exception as e:
            graphs, breaks = [], 1
        if len(graphs) != 1 or breaks:
            if len(cases) == 1:
                return self.run_alone(cases[0], "graph break or no single graph")
            return self.split(cases, depth)
        graph, example_inputs = graphs[0]
        by_identity = {id(t): owner[i] for i, t in enumerate(tensors)}
        input_owner = [by_identity.get(id(t), -1) for t in example_inputs]
        with tempfile.TemporaryDirectory() as debug_dir:
            previous = os.environ.get("KILN_DEBUG_DIR")
            os.environ["KILN_DEBUG_DIR"] = debug_dir
            try:
                compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
            finally:
                if previous is None:
                    del os.environ["KILN_DEBUG_DIR"]
                else:
                    os.environ["KILN_DEBUG_DIR"] = previous
            summary = kiln._C.compiled_graph_summary(compiled)
            dumps = glob.glob(os.path.join(debug_dir, "*.graph.txt"))
            graph_text = open(dumps[0]).read() if dumps else ""
        self.compiles += 1
        if summary["backend"] != "kiln":
            if len(cases) == 1:
                cases[0].kind, cases[0].reason = "fallback", summary["fallback_reason"]
                self.check_end_to_end(cases)
                return
            return self.split(cases, depth, summary["fallback_reason"])
        if len(cases) == 1:  # nodes that read no input (factory ops) are the single case's too
            covered = {0} if summary["kernels"] else set()
        else:
            covered = kernel_node_owners(graph_text, summary["source"], input_owner) if summary["kernels"] else set()
        if not self.check_end_to_end(cases):
            if len(cases) == 1:
                cases[0].kind = "extern"
                return
            return self.split(cases, depth)
        for i, case in enumerate(cases):
            case.kind = "generated" if i in covered else "extern"

    def split(self, cases, depth, reason=""):
        # A fallback reason that names an op ("in-place op aten::cauchy_.default"): the cases whose own graphs
        # hold it go alone and the rest stay one batch, which saves the bisection's compiles.
        named = re.findall(r"aten::[\w.]+", reason)
        culprits = [c for c in cases if any(op in named for ops in c.graph_ops for op in ops)]
        if culprits and len(culprits) < len(cases):
            for case in culprits:
                self.run_batch([case], depth + 1)
            return self.run_batch([c for c in cases if c not in culprits], depth + 1)
        half = len(cases) // 2
        self.run_batch(cases[:half], depth + 1)
        self.run_batch(cases[half:], depth + 1)


def trace_alone(case):
    """(graph op lists, broke) for the case traced by itself: cheap, no C++ compiler run."""
    fn, tensors, _ = make_batch_function([case])
    try:
        graphs, breaks = capture(fn, tensors)
    except Exception as e:
        return [], f"trace raised {type(e).__name__}"
    if len(graphs) != 1 or breaks:
        return [g.ops() for g, _ in graphs], f"graph break ({len(graphs)} graphs)"
    return [graphs[0][0].ops()], ""


def format_report(dtype, cases, skipped, seconds, compiles):
    counts = {k: sum(1 for c in cases if c.kind == k) for k in ("generated", "extern", "fallback")}
    supported = len(cases)
    covered = counts["generated"] + counts["extern"]
    lines = [f"== OpInfo sweep, {dtype}: {supported} ops eager supports; generated {counts['generated']}, "
             f"extern {counts['extern']}, fallback {counts['fallback']} "
             f"({100.0 * covered / max(supported, 1):.1f}% generated+extern); skipped {len(skipped)}; "
             f"{compiles} batch compiles, {seconds:.1f} s"]
    for c in sorted(cases, key=lambda c: (c.kind, c.key)):
        note = "" if c.values_comparable else " (compared by dtype/shape only)"
        lines.append(f"  {c.kind:9s} {c.key}{note}" + (f"  [{c.reason}]" if c.reason else ""))
    for key, why in sorted(skipped.items()):
        lines.append(f"  skipped   {key}  [{why}]")
    return "\n".join(lines), counts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
def test_opinfo_sweep(dtype, device, tmp_path):
    start = time.time()
    skipped = {}
    cases = collect_cases(dtype, skipped, device)
    sweep = Sweep()
    batchable = []
    for case in cases:
        ops, broke = trace_alone(case)
        case.graph_ops = ops
        if broke:
            sweep.run_alone(case, broke)
        elif not case.tensors:
            sweep.run_batch([case])  # its nodes read no input: compiled alone so they are attributed to it
        else:
            batchable.append(case)
    for i in range(0, len(batchable), BATCH_SIZE):
        sweep.run_batch(batchable[i:i + BATCH_SIZE])
    report, counts = format_report(f"{dtype} on {device}", cases, skipped, time.time() - start, sweep.compiles)
    known, failures = [], []
    for case, message in sweep.failures:
        issue = next((name for name, matches in KNOWN_ISSUES.items() if matches(case, message)), None)
        (known if issue else failures).append(f"  {'KNOWN ' + issue if issue else 'MISMATCH'}: {case.key}: {message}")
    text = "\n".join([report] + known + failures)
    (tmp_path / "opinfo_report.txt").write_text(text + "\n")
    print("\n" + text)
    assert all(c.kind for c in cases)
    assert not failures, f"{len(failures)} ops differ from eager:\n" + "\n".join(failures)
    supported = len(cases)
    assert counts["generated"] + counts["extern"] >= COVERAGE_FLOOR[device][dtype] * supported, report.splitlines()[0]


# ---- edge values of the generated math ---------------------------------------------------------------------
# OpInfo's first samples are random normals; these are the values where formulas part ways (NaN, infinities,
# signed zeros, halves for rounding, signs for remainder). One compiled function, so one compile.
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1.0, -1.0, 3.0, 0.25,
           -7.0, 1e30, -1e-30]


def edge_math(x, y):
    return (torch.sign(x), torch.round(x), torch.frac(x), torch.trunc(x), torch.ceil(x), torch.floor(x),
            torch.signbit(x), torch.isnan(x), torch.isinf(x), torch.isposinf(x), torch.isneginf(x),
            torch.remainder(x, y), torch.fmod(x, y), torch.fmax(x, y), torch.fmin(x, y), torch.copysign(x, y),
            torch.atan2(x, y), torch.hypot(x, y), torch.xlogy(x, y), torch.heaviside(x, y), torch.nan_to_num(x),
            torch.nan_to_num(x, 1.0, 2.0, -2.0), torch.lerp(x, y, 0.3), torch.lerp(x, y, 0.7), torch.reciprocal(x),
            torch.logit(x.abs() / 4, eps=0.01), torch.nn.functional.softplus(x), torch.nn.functional.mish(x),
            torch.nn.functional.elu(x), torch.nn.functional.hardswish(x), torch.nn.functional.hardshrink(x),
            torch.nn.functional.softshrink(x), torch.expm1(x), torch.log1p(x), torch.exp2(x), torch.erfc(x),
            torch.logical_xor(x, y), x.any(), x.all(), torch.logsumexp(x.view(-1, 1).expand(-1, 3), 1),
            torch.var(x[5:], correction=0), torch.std_mean(y, dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_edge_values_of_generated_math(dtype):
    x = torch.tensor(SPECIAL, dtype=dtype)
    y = torch.tensor(SPECIAL[::-1], dtype=dtype)
    kiln.reset()
    before = kiln._C.compiler_stats()["graphs_fallback"]
    with torch.no_grad():
        actual = kiln.compile(edge_math, backend="kiln", fullgraph=True)(x, y)
        expected = edge_math(x, y)
    assert kiln._C.compiler_stats()["graphs_fallback"] == before
    kiln.reset()
    for i, (a, e) in enumerate(zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected))):
        rtol, atol = tolerance(e.dtype, "general")
        assert a.dtype == e.dtype and a.shape == e.shape, i
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"result {i}: {m}")
