"""The OpInfo sweep under dynamic shapes (issue #25): each op of op_db compiled once with
`kiln.compile(fn, dynamic=True)` and called at two sizes, against eager at both.

For each op that test_opinfo_sweep would take as a case (float32; dtype supported, not an in-place variant, eager
succeeds and returns tensors) the sweep looks for a *pair* of samples with the same structure: the same pytree
spec of (args, kwargs), equal non-tensor leaves, tensors of the same dtypes, ranks and devices, but a different
size in at least one dim. Pairs are graded: "ideal" (every dim that differs is >= 2 at both sizes, so it stays
symbolic and the first graph can serve the second call, and the two samples agree on what else kiln's guards
read: which dims are equal to each other, since equal sizes at the first call are tied by duck sizing, and each
tensor's contiguity and offset), "ideal with new ties or layouts" (the same, but those relations differ, so a
guard fails by design), "partial" (one such dim, others differ through size 0 or 1, which kiln specialises),
"0/1" (sizes differ only through 0 or 1: the second call recompiles by design); the first pair of the best grade
is taken. op.sample_inputs is searched first; where it has no ideal pair (many ops have a single sample there,
e.g. the unary ufuncs) the op's reference_inputs are searched too (its first REFERENCE_SAMPLES).
Ops with no pair are counted as such.

The pairs are compiled in batches, as in test_opinfo_sweep (its make_batch_function: one generated function
calls each case's op on its own input tensors): the batch function is compiled with `dynamic=True` (kiln
backend, C++ kernels), called with every case's sample A, then with every case's sample B; every result is
compared with eager by test_opinfo_sweep's rules (structure, dtype, shape, NaN positions, values within
kiln.testing's "general" tolerance; random ops and uninitialised memory by dtype and shape only). A batch that
raises is bisected down to the op responsible; an op that mismatches in a batch is checked again alone (also
dynamic=True), and it fails whether or not the mismatch remains alone. Graph breaks and eager fallbacks are
not mismatches (kiln runs those parts eagerly); an op whose kiln call raises is a failure.

Frames: each op is first traced alone at both sizes (dynamic=True, a backend that replays the graph on kiln's
eager interpreter: no C++ compile), which counts the frames its guards need (1: one graph served both sizes;
2+: a guard failed, e.g. a size an op's rule specialises, and the frame recompiled; recompiles are allowed) and
finds the ops that break the graph. Three groups are batched apart: the 1-frame ops, the 2+-frame ops and the
ops that break. A batch of 1-frame ops whose B call still compiles again (duck sizing ties equal sizes of
different ops at the first call) is bisected until each part's graph serves both sizes, so that every 1-frame
op meets sample B in the graph traced at sample A, which is what this sweep is for. The report gives the batch
compiles and how many kept one frame.

Cost: about 95 s on the 2-core development machine (CPU, cold kernel cache), over 100 C++ compiles.
`pytest -s` prints the report: ops tried, pairs found, mismatches, ops with 1 vs 2+ frames, seconds.
"""
import itertools
import time

import pytest
import torch
from torch.utils import _pytree as pytree

# The sweep's cases, batch functions, comparison rules and module fixtures (a cold KILN_CACHE_DIR; op_db's
# wrapper_set_seed replaced by a plain call). Importing it also installs its expecttest stand-in where needed.
from test_opinfo_sweep import (  # noqa: F401  (the fixtures are used by pytest, not by name)
    BATCH_SIZE, SEEDED_RERUNS, UNINITIALISED, Case, compare, kiln_cache_dir, make_batch_function,
    ops_without_seed_wrapper, same_result, seeded_by_op_db, sweep_ops, tensors_only)

import kiln

# reference_inputs can be long (and large): only its first REFERENCE_SAMPLES are searched for a pair.
REFERENCE_SAMPLES = 64
GRADES = {4: "ideal", 3: "ideal, new ties", 2: "partial", 1: "0/1"}

# Mismatches whose cause is known and tracked elsewhere, each a predicate over (pair, message), as in
# test_opinfo_sweep.KNOWN_ISSUES. They are listed in the report; any other mismatch fails the test.
KNOWN_ISSUES = {}


# ---- finding a pair of samples -----------------------------------------------------------------------------
def _signature(sample):
    tree = ((sample.input,) + tuple(sample.args), dict(sample.kwargs))
    leaves, spec = pytree.tree_flatten(tree)
    return spec, leaves


def _same_leaf(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.dim() == b.dim() and a.device == b.device and a.layout == b.layout == torch.strided)
    if type(a) is not type(b):
        return False
    try:
        return bool(a is b or a == b)
    except Exception:
        return False


def _relations(tensors):
    """What kiln's guards may read besides the sizes themselves: which dims (>= 2) are equal to each other (equal
    sizes handed to one call are tied by a guarded equality), and each tensor's contiguity and offset."""
    dims = [n for t in tensors for n in t.shape]
    ties = [[j for j, m in enumerate(dims) if m == n] for n in dims if n >= 2]
    return ties, [(t.is_contiguous(), t.storage_offset() == 0) for t in tensors]


def _grade(leaves_a, leaves_b):
    """0: no size differs; 4 ideal with the same relations, 3 ideal, 2 partial, 1 only through sizes 0 and 1
    (see the module doc)."""
    dims = [(p, q) for x, y in zip(leaves_a, leaves_b) if isinstance(x, torch.Tensor)
            for p, q in zip(x.shape, y.shape)]
    if all(p == q for p, q in dims):
        return 0
    if all(p == q or (p >= 2 and q >= 2) for p, q in dims):
        tensors_a = [x for x in leaves_a if isinstance(x, torch.Tensor)]
        tensors_b = [y for y in leaves_b if isinstance(y, torch.Tensor)]
        return 4 if _relations(tensors_a) == _relations(tensors_b) else 3
    if any(p != q and p >= 2 and q >= 2 for p, q in dims):
        return 2
    return 1


def best_pair(samples):
    """(grade, sample A, sample B): the first pair of the best grade, in sample order."""
    signatures = [_signature(s) for s in samples]
    best = (0, None, None)
    for i, j in itertools.combinations(range(len(samples)), 2):
        (spec_a, leaves_a), (spec_b, leaves_b) = signatures[i], signatures[j]
        if spec_a != spec_b or len(leaves_a) != len(leaves_b):
            continue
        if not all(_same_leaf(x, y) for x, y in zip(leaves_a, leaves_b)):
            continue
        grade = _grade(leaves_a, leaves_b)
        if grade > best[0]:
            best = (grade, samples[i], samples[j])
            if grade == 4:
                break
    return best


def shapes(case):
    return "+".join(str(list(t.shape)).replace(" ", "") for t in case.tensors) or "-"


class Pair:
    def __init__(self, op, a, b, grade, source):
        self.op, self.a, self.b, self.grade, self.source = op, a, b, grade, source
        self.key = a.key
        self.frames = None   # frames compiled over both calls, traced alone
        self.broke = ""      # why the trace alone was not one graph

    def describe(self):
        return f"{self.key} ({GRADES[self.grade]}, {self.source}) {shapes(self.a)} -> {shapes(self.b)}"


def eager_expected(case):
    """Sets case.expected and case.values_comparable as test_opinfo_sweep.collect_cases does; returns why the
    case is skipped, or ""."""
    with torch.no_grad():
        torch.manual_seed(1)
        expected = case.call()
        if not tensors_only(expected):
            return "non-tensor (or sparse) output"
        expected = pytree.tree_map(torch.clone, expected)
        reruns = 1 + (SEEDED_RERUNS if seeded_by_op_db(case.op) else 0)
        deterministic = True
        for seed in range(2, 2 + reruns):
            torch.manual_seed(seed)
            deterministic = deterministic and same_result(expected, case.call())
    case.expected = expected
    case.values_comparable = case.op.name.split(".")[-1] not in UNINITIALISED and deterministic
    return ""


def collect_pairs(dtype, device, skipped, no_pair):
    pairs = []
    for key, op in sweep_ops(skipped, lambda op: dtype in op.supported_dtypes(device)):
        try:
            torch.manual_seed(0)
            samples = list(op.sample_inputs(device, dtype, requires_grad=False))
            grade, a, b = best_pair(samples)
            source = "sample_inputs"
            if grade < 4 and op.reference_inputs_func is not None:
                torch.manual_seed(0)
                references = list(itertools.islice(op.reference_inputs(device, dtype, requires_grad=False),
                                                   REFERENCE_SAMPLES))
                found = best_pair(references)
                if found[0] > grade:
                    (grade, a, b), source = found, "reference_inputs"
            if not samples:
                skipped[key] = "no sample"
                continue
            if grade == 0:
                no_pair.append(key)
                continue
            case_a, case_b = Case(op, dtype, a), Case(op, dtype, b)
            why = eager_expected(case_a) or eager_expected(case_b)
        except Exception as e:
            skipped[key] = f"eager raises {type(e).__name__}"
            continue
        if why:
            skipped[key] = why
            continue
        # Every tensor must become a parameter of the batch function (one inside a dict would be a constant,
        # and the second call would still see sample A's).
        if any(len(make_batch_function([c])[1]) != len(c.tensors) for c in (case_a, case_b)):
            skipped[key] = "a tensor the batch function cannot take as a parameter"
            continue
        pairs.append(Pair(op, case_a, case_b, grade, source))
    return pairs


# ---- frames: each op traced alone at both sizes ------------------------------------------------------------
def _interpreted(graph, example_inputs):
    return lambda xs: kiln._C.run_graph(graph, "eager", xs)


def trace_pair(pair):
    """Frames compiled for the pair's two calls under dynamic=True, and why it was not one graph ("" if it was).
    The graphs run on kiln's eager interpreter: tracing and guards only, no C++ compile."""
    fn, tensors_a, _ = make_batch_function([pair.a])
    _, tensors_b, _ = make_batch_function([pair.b])
    kiln.reset()
    try:
        compiled = kiln.compile(fn, dynamic=True, backend=_interpreted)
        with torch.no_grad():
            compiled(*tensors_a)
            compiled(*tensors_b)
        stats = kiln.stats()
    except Exception as e:
        return None, f"trace raised {type(e).__name__}"
    finally:
        kiln.reset()
    breaks = stats["graph_breaks"] + stats["fallbacks"]
    return stats["frames_compiled"], (f"{breaks} graph breaks/fallbacks" if breaks else "")


# ---- batches under the kiln backend ------------------------------------------------------------------------
class DynamicSweep:
    def __init__(self):
        self.failures = []   # (pair, message)
        self.batches = []    # (number of pairs, frames after A, frames after B)
        self.reused = 0      # pairs checked in a batch whose first graph served the B call too

    def check(self, pairs):
        """kiln.compile(batch, dynamic=True) called with every sample A, then every sample B. Returns the pairs
        that mismatched and whether the B call compiled another frame, or None if kiln raised."""
        fn, tensors_a, _ = make_batch_function([p.a for p in pairs])
        _, tensors_b, _ = make_batch_function([p.b for p in pairs])
        kiln.reset()
        mismatched = {}
        try:
            compiled = kiln.compile(fn, dynamic=True)
            with torch.no_grad():
                for size, cases, tensors in (("A", [p.a for p in pairs], tensors_a),
                                             ("B", [p.b for p in pairs], tensors_b)):
                    torch.manual_seed(1)
                    results = compiled(*tensors)
                    for pair, case, actual in zip(pairs, cases, results):
                        message = compare(case, actual)
                        if message and pair.key not in mismatched:
                            mismatched[pair.key] = f"at {size} {shapes(case)}: {message}"
                    if size == "A":
                        frames_a = kiln.stats()["frames_compiled"]
            frames_b = kiln.stats()["frames_compiled"]
            self.batches.append((len(pairs), frames_a, frames_b))
        except Exception as e:
            if len(pairs) == 1:
                self.failures.append((pairs[0], f"kiln raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"))
            return None
        finally:
            kiln.reset()
        return [(p, mismatched[p.key]) for p in pairs if p.key in mismatched], frames_b > frames_a

    def run(self, pairs, one_frame=False):
        """Checks a batch; one that raises is bisected. With `one_frame` (ops that kept one frame when traced
        alone) a batch whose B call compiled again is bisected too, until each part's graph serves both sizes:
        otherwise sample B would only meet a graph traced at its own sizes, not the reuse this sweep is for."""
        checked = self.check(pairs)
        if checked is None or (one_frame and checked[1] and len(pairs) > 1):
            if len(pairs) > 1:
                half = len(pairs) // 2
                self.run(pairs[:half], one_frame)
                self.run(pairs[half:], one_frame)
            return
        mismatched, recompiled = checked
        if not recompiled:
            self.reused += len(pairs)
        for pair, message in mismatched:
            if len(pairs) == 1:
                self.failures.append((pair, message))
                continue
            again = self.check([pair])  # alone, also dynamic=True; a raise alone is recorded by check
            if again is not None and not again[0]:
                self.failures.append((pair, f"mismatch within its batch only (alone it matches): {message}"))
            elif again is not None:
                self.failures.append(again[0][0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_opinfo_dynamic_two_sizes(device):
    dtype = torch.float32
    start = time.time()
    skipped, no_pair = {}, []
    pairs = collect_pairs(dtype, device, skipped, no_pair)
    for pair in pairs:
        pair.frames, pair.broke = trace_pair(pair)
    sweep = DynamicSweep()
    one = [p for p in pairs if p.frames == 1 and not p.broke]
    more = [p for p in pairs if p.frames != 1 and not p.broke]
    broken = [p for p in pairs if p.broke]
    # Batched apart: the ops whose graph served both sizes alone, those that recompiled, those that break.
    for group in (one, more, broken):
        for i in range(0, len(group), BATCH_SIZE):
            sweep.run(group[i:i + BATCH_SIZE], one_frame=group is one)
    seconds = time.time() - start

    known, failures = [], []
    for pair, message in sweep.failures:
        issue = next((name for name, matches in KNOWN_ISSUES.items() if matches(pair, message)), None)
        (known if issue else failures).append(
            f"  {'KNOWN ' + issue if issue else 'MISMATCH'}: {pair.describe()}: {message}")
    grades = {g: sum(1 for p in pairs if p.grade == g) for g in GRADES}
    from_reference = sum(1 for p in pairs if p.source == "reference_inputs")
    kept = sum(1 for n, fa, fb in sweep.batches if fb == fa)
    lines = [
        f"== OpInfo dynamic sweep, {dtype} on {device}: {len(pairs) + len(no_pair)} ops tried, {len(pairs)} pairs "
        f"(ideal {grades[4]}, ideal with new ties or layouts {grades[3]}, partial {grades[2]}, 0/1 {grades[1]}; "
        f"{from_reference} from reference_inputs), {len(no_pair)} no pair, {len(skipped)} skipped; "
        f"{len(failures)} mismatches, {len(known)} known",
        f"   frames per op (traced alone, both sizes): 1 frame {len(one)}, 2+ frames {len(more)}, "
        f"graph breaks {len(broken)}; {len(sweep.batches)} batch compiles ({kept} kept one frame at B, "
        f"{len(sweep.batches) - kept} compiled again); {sweep.reused} ops checked in a batch whose first graph "
        f"served B; {seconds:.1f} s"]
    lines += [f"  2+ frames  {p.describe()}: {p.frames}" for p in sorted(more, key=lambda p: p.key)]
    lines += [f"  broke      {p.describe()}: {p.broke}" for p in sorted(broken, key=lambda p: p.key)]
    lines += [f"  no pair    {', '.join(sorted(no_pair))}"]
    lines += known + failures
    print("\n" + "\n".join(lines))
    assert not failures, f"{len(failures)} ops differ from eager under dynamic=True:\n" + "\n".join(failures)
