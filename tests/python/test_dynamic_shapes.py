"""Dynamic shapes through kiln.compile (issue #25): one compiled frame serves every size.

Each test compiles a function or module under a `dynamic` policy, calls it at several sizes (primes, 2 and 3, sizes
that are not multiples of the vector width, one larger size) with fresh random inputs and compares with eager using
the tolerance table of DESIGN.md; then it asserts how many frames were compiled, which is what the policy promises:
`dynamic=True` compiles once, `dynamic=None` (automatic) twice (the first size, then the second distinct size with
the changed dims symbolic), `dynamic=False` once per size. Sizes 0 and 1 stay specialised (a size-1 call compiles
its own graph). Each new set of sizes still lowers its kernels once (kiln.stats()["dynamic_specialisations"]): that
is the runtime's business (tests/python/test_dynamic_runtime.py), not the tracer's.
"""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.testing import random_tensor, tolerance

SIZES = [5, 2, 13, 3, 64, 7]


@pytest.fixture
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def same(actual, expected, kind="general"):
    actual = actual if isinstance(actual, (tuple, list)) else [actual]
    expected = expected if isinstance(expected, (tuple, list)) else [expected]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if not isinstance(e, torch.Tensor):
            assert a == e
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape)
        rtol, atol = tolerance(e.dtype, kind)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def run_sizes(fn, make, dynamic=True, sizes=SIZES, kind="general"):
    """Calls kiln.compile(fn, dynamic=dynamic) at each size (make(n) -> args) against eager; returns kiln.stats()."""
    compiled = kiln.compile(fn, dynamic=dynamic)
    for n in sizes:
        args = make(n)
        same(compiled(*args), fn(*args), kind)
    return kiln.stats()


# ---- policies --------------------------------------------------------------------------------------------------
def scale_rows(x, w):
    return (x * w).softmax(-1) + x.mean(0)


def rows(n):
    return random_tensor(n, 24), random_tensor(24)


@pytest.mark.parametrize("dynamic,frames", [(True, 1), (None, 2), (False, len(SIZES))])
def test_each_policy_compiles_as_many_frames_as_torch_compiles_would(fresh, dynamic, frames):
    stats = run_sizes(scale_rows, rows, dynamic)
    assert stats["frames_compiled"] == frames, stats
    assert stats["fallbacks"] == 0


def test_automatic_makes_only_the_dims_that_changed_symbolic(fresh):
    compiled = kiln.compile(scale_rows)
    for n in (4, 9, 17):
        x, w = rows(n)
        same(compiled(x, w), scale_rows(x, w))
    assert kiln.stats()["frames_compiled"] == 2
    # The feature dim never changed: it stayed specialised, so a new width compiles again.
    x, w = random_tensor(9, 10), random_tensor(10)
    same(compiled(x, w), scale_rows(x, w))
    assert kiln.stats()["frames_compiled"] == 3


class Cache:
    """A key/value cache as generation code keeps one: tensors in attributes of an object passed as an argument."""
    def __init__(self, keys, values):
        self.layers = [types.SimpleNamespace(keys=keys, values=values)]


def attend_with_cache(q, cache, grouped):
    layer = cache.layers[0]
    return F.scaled_dot_product_attention(q, layer.keys, layer.values, enable_gqa=grouped) * 2


@pytest.mark.parametrize("grouped", [False, True], ids=["heads", "grouped_heads"])
def test_automatic_follows_tensors_in_an_arguments_attributes(fresh, grouped):
    # one query row against a cache that grows by a row per call (a generation step): the third length on reuses
    # the graph with the cache's length as a size symbol, as torch.compile's automatic dynamic shapes do
    compiled = kiln.compile(attend_with_cache)
    kv_heads = 2 if grouped else 4
    for length in range(6, 14):
        q = random_tensor(2, 4, 1, 16)
        cache = Cache(random_tensor(2, kv_heads, length, 16), random_tensor(2, kv_heads, length, 16))
        same(compiled(q, cache, grouped), attend_with_cache(q, cache, grouped))
    stats = kiln.stats()
    assert stats["frames_compiled"] == 2 and stats["recompiles"] == 1, stats
    assert stats["dynamic_specialisations"] == 7, stats  # each new length lowers the one symbolic graph


def test_dynamic_true_makes_tensors_in_an_arguments_attributes_symbolic(fresh):
    compiled = kiln.compile(attend_with_cache, dynamic=True)
    for length in (6, 7, 8):
        q = random_tensor(2, 4, 1, 16)
        cache = Cache(random_tensor(2, 4, length, 16), random_tensor(2, 4, length, 16))
        same(compiled(q, cache, False), attend_with_cache(q, cache, False))
    assert kiln.stats()["frames_compiled"] == 1, kiln.stats()


def test_tensors_held_by_modules_stay_static(fresh):
    # a buffer's size change recompiles (torch.compile's default: module state is specialised)
    module = nn.Linear(4, 4)
    compiled = kiln.compile(lambda m, x: x + m.extra.sum())
    for n in (3, 5, 7):
        module.register_buffer("extra", random_tensor(n))
        x = random_tensor(4)
        same(compiled(module, x), x + module.extra.sum())
    assert kiln.stats()["frames_compiled"] == 3, kiln.stats()


def test_mark_dynamic_is_symbolic_from_the_first_call_and_explain_lists_the_symbols(fresh):
    def f(x):
        return x.sum(1) + x.shape[1]  # (added, not multiplied: a product would scale the sum's rounding past atol)

    x = random_tensor(6, 10)
    kiln.mark_dynamic(x, 1)
    e = kiln.explain(f, backend="kiln")(x)
    assert e.dynamic == [["s0 = x.size(1)"]], e.dynamic
    compiled = kiln.compile(f)
    for n in (10, 3, 29):
        y = random_tensor(6, n)
        kiln.mark_dynamic(y, 1)
        same(compiled(y), f(y))
    assert kiln.stats()["frames_compiled"] == 2  # (explain's own compile, then one for every size)


def test_mark_static_keeps_a_dim_specialised_under_dynamic_true(fresh):
    compiled = kiln.compile(scale_rows, dynamic=True)
    for n in (4, 9):
        x, w = rows(n)
        kiln.mark_static(x, 0)
        same(compiled(x, w), scale_rows(x, w))
    assert kiln.stats()["frames_compiled"] == 2


def test_sizes_0_and_1_stay_specialised(fresh):
    stats = run_sizes(scale_rows, rows, True, sizes=[5, 1, 9, 1])
    assert stats["frames_compiled"] == 2, stats  # sizes >= 2, and size 1
    compiled = kiln.compile(lambda x: x.sum(0) + 1, dynamic=True)
    for n in (0, 3, 0, 6):
        x = random_tensor(n, 4)
        same(compiled(x), x.sum(0) + 1)


# ---- ops at symbolic sizes -------------------------------------------------------------------------------------
OPS = {
    "pointwise_broadcast": (lambda x, b: torch.tanh(x) * b + x.sigmoid(), lambda n: (random_tensor(n, 7), random_tensor(7))),
    "reductions": (lambda x, b: (x.sum(0), x.amax(1), x.mean(), (x * b).var(0), x.cumsum(0), x.argmax(1)),
                   lambda n: (random_tensor(n, 7), random_tensor(7))),
    "softmax": (lambda x, b: F.softmax(x, -1) + F.log_softmax(x.t(), -1).t(), lambda n: (random_tensor(3, n), random_tensor(1))),
    "layer_norm": (lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None), lambda n: (random_tensor(2, n, 12), random_tensor(12))),
    "matmul": (lambda x, w: (x @ w, F.linear(x, w.t()).relu()), lambda n: (random_tensor(2, n, 12), random_tensor(12, 8))),
    "conv2d": (lambda x, w: F.relu(F.conv2d(x, w, padding=1)), lambda n: (random_tensor(n, 3, n + 4, 10), random_tensor(4, 3, 3, 3))),
    "attention": (lambda q, k: F.scaled_dot_product_attention(q, k, k, is_causal=False),
                  lambda n: (random_tensor(2, 4, n, 16), random_tensor(2, 4, n + 3, 16))),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_ops_match_eager_at_every_size_with_one_compile(fresh, name):
    fn, make = OPS[name]
    stats = run_sizes(fn, make, True, kind="general")
    assert stats["frames_compiled"] == 1, stats
    assert stats["fallbacks"] == 0


def test_views_and_reshapes_from_read_sizes(fresh):
    def heads(x, w):
        b, s, d = x.shape
        q = (x @ w).view(b, s, 4, d // 4).transpose(1, 2)
        return q.reshape(b * 4, s, -1).sum(-1), q.flatten(2).shape[-1] * x

    stats = run_sizes(heads, lambda n: (random_tensor(3, n, 16), random_tensor(16, 16)), True)
    assert stats["frames_compiled"] == 1, stats


def test_slicing_by_an_int_computed_from_sizes(fresh):
    # The int must follow the size: a graph that kept `:3` would give the wrong shape at every other size.
    def halves(x):
        n = x.shape[1] // 2
        return x[:, :n] * 2, x[:, n:].sum(1), x[:, 1:n + 1] - 1

    stats = run_sizes(halves, lambda n: (random_tensor(2, 2 * n + 1),), True)
    assert stats["frames_compiled"] == 1, stats


def test_positions_from_arange_of_the_sequence_length(fresh):
    def embed(ids, table):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return table[ids] + table[positions].unsqueeze(0)

    stats = run_sizes(embed, lambda n: (torch.randint(0, 50, (2, n)), random_tensor(80, 8)), True)
    assert stats["frames_compiled"] == 1, stats


def test_a_literal_equal_to_a_size_is_not_taken_for_it(fresh):
    # At the first call x.shape[0] == 4: the literal 4 must stay 4 at batch 8.
    def fold(x):
        return x.view(4, -1).sum(1)

    compiled = kiln.compile(fold, dynamic=True)
    for n in (4, 8, 12):
        x = random_tensor(n, 6)
        same(compiled(x), fold(x))


def test_a_branch_on_a_size_is_guarded(fresh):
    def branch(x):
        if x.shape[0] > 8:
            return x.sum(0)
        return x * 2

    compiled = kiln.compile(branch, dynamic=True)
    for n in (4, 6, 12, 20, 5):
        x = random_tensor(n, 3)
        same(compiled(x), branch(x))
    assert kiln.stats()["frames_compiled"] == 2  # one per side of the branch


def test_an_int_that_leaves_for_python_is_pinned(fresh):
    # range(n) unrolls a loop per n: the graph holds only for that n (a guard), never a wrong count.
    def loop(x):
        out = x
        for _ in range(x.shape[0] - 1):
            out = out * 0.5
        return out

    compiled = kiln.compile(loop, dynamic=True)
    for n in (3, 5, 3):
        x = random_tensor(n, 2)
        same(compiled(x), loop(x))
    assert kiln.stats()["frames_compiled"] == 2


def test_a_constant_tensor_made_from_a_size_is_pinned(fresh):
    # torch.tensor(n) of a size records no op: the tensor is a constant of the graph, so the size it was made from
    # is specialised (it once kept its symbol, and the graph added the first call's length at every length).
    # torch.div of two ints is computed for real the same way (Longformer / LED's chunk counts), then read back
    # as a view's size.
    def f(x):
        chunks = torch.div(x.shape[1], 2, rounding_mode="trunc")
        pairs = x[:, : 2 * (x.shape[1] // 2)].reshape(x.shape[0], chunks, 2)
        return x + torch.tensor(x.shape[0]) + torch.tensor([x.shape[-1], 2.0]).sum(), pairs.sum(-1)

    compiled = kiln.compile(f, dynamic=True)
    for n in (3, 5, 3, 7):
        x = random_tensor(2, n)
        same(compiled(x), f(x))
    stats = kiln.stats()
    assert stats["frames_compiled"] == 3 and stats["graph_breaks"] == 0, stats


def test_shapes_concatenated_with_tuples_stay_symbolic(fresh):
    # GPT-2's Conv1D: `x.size()[:-1] + (nf,)`, a torch.Size of size symbols and a tuple, is a torch.Size of the
    # same symbols (it was computed in Python, which pinned every length: one graph per sequence length).
    def f(x):
        size_out = x.size()[:-1] + (4,)
        flat = x.view(-1, x.size(-1)) * 2
        shape = (1,) + x.shape[1:]
        return flat.view(size_out), x[:1].reshape(shape), isinstance(size_out, torch.Size), len(x.shape[:1] * 2)

    compiled = kiln.compile(f, dynamic=True)
    for n in (3, 5, 9):
        x = random_tensor(2, n, 4)
        same(compiled(x), f(x))
    stats = kiln.stats()
    assert stats["frames_compiled"] == 1 and stats["graph_breaks"] == 0, stats


# ---- modules and training --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm(x))


def test_transformer_block_over_sequence_lengths(fresh, device):
    torch.manual_seed(0)
    model = Block().eval().to(device)
    compiled = kiln.compile(model)
    with torch.no_grad():
        for n in (37, 53, 77, 101, 37):
            x = random_tensor(4, n, 32, device=device)
            same(compiled(x), model(x))
    assert kiln.stats()["frames_compiled"] == 2  # automatic: the first length, then every other one


def test_training_under_changing_lengths_matches_eager(fresh, device):
    torch.manual_seed(0)
    model = Block().to(device)
    twin = Block().to(device)
    twin.load_state_dict(model.state_dict())
    compiled = kiln.compile(model, dynamic=True)
    for n in (9, 14, 23):
        x = random_tensor(3, n, 32, device=device)
        loss = compiled(x).square().mean()
        loss.backward()
        expected = twin(x).square().mean()
        expected.backward()
        same(loss, expected)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            rtol, atol = tolerance(torch.float32, "general")
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol * 10, atol=atol * 10, msg=name)
            p.grad = q.grad = None
    assert kiln.stats()["frames_compiled"] == 1


def test_a_size_outside_mark_dynamics_range_raises(fresh):
    def f(x):
        return x * 2

    compiled = kiln.compile(f)
    for n in (4, 9, 16):
        x = random_tensor(n, 3)
        kiln.mark_dynamic(x, 0, min=2, max=16)
        same(compiled(x), f(x))
    assert kiln.stats()["frames_compiled"] == 1
    x = random_tensor(17, 3)
    kiln.mark_dynamic(x, 0, min=2, max=16)
    with pytest.raises(kiln.errors.KilnError, match=r"s0 <= 16 \(the range kiln.mark_dynamic declared for x.size\(0\)\) fails at s0 = x.size\(0\) = 17"):
        compiled(x)
    fresh_x = random_tensor(40, 3)
    kiln.mark_dynamic(fresh_x, 0, max=32)
    with pytest.raises(kiln.errors.KilnError, match=r"x.size\(0\) is 40, outside the range kiln.mark_dynamic declared"):
        kiln.compile(lambda x: x + 1)(fresh_x)


def test_multi_head_attention_fast_path_over_lengths(fresh):
    # nn.MultiheadAttention under no_grad in eval takes eager's fused path (aten::_native_multi_head_attention).
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=True).eval()

    def attend(x):
        return attention(x, x, x, need_weights=False)[0]

    with torch.no_grad():
        stats = run_sizes(attend, lambda n: (random_tensor(2, n + 3, 32),), True)
    assert stats["frames_compiled"] == 1, stats


def test_integer_mask_comparisons_over_lengths(fresh):
    # An attention mask as transformers builds it: int64, expanded over a query dim (stride 0), compared.
    def mask(m, scores):
        b, s = m.shape
        expanded = m[:, None, None, :].expand(b, 1, s, s)
        return scores.masked_fill(expanded == 0, -1e4).softmax(-1), (expanded >= 1).float().sum(-1)

    def make(n):
        m = torch.ones(3, n, dtype=torch.long)
        m[1, n // 2:] = 0
        return m, random_tensor(3, 2, n, n)

    stats = run_sizes(mask, make, True)
    assert stats["frames_compiled"] == 1, stats


def test_bool_masks_combined_over_lengths(fresh):
    # A padding mask and a causal mask combined with & and |, as transformers' mask functions do.
    def combine(m):
        s = m.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        padding = m[:, None, :].bool().expand(-1, s, -1)
        return (causal & padding).float(), (causal | padding).float().sum(-1), (causal ^ padding).float().mean()

    def make(n):
        m = torch.ones(3, n, dtype=torch.long)
        m[1, n // 2:] = 0
        return (m,)

    stats = run_sizes(combine, make, True)
    assert stats["frames_compiled"] == 1, stats


# A process of a job: compiles PROFILE_FN under the automatic policy, calls it at the sizes on its command line against
# eager, and prints the frames it compiled.
PROFILE_CHILD = r"""
import sys, torch, kiln
from kiln.testing import random_tensor, tolerance
def scaled_rows(x):
    return torch.softmax(x * 2, -1).sum(0)
compiled = kiln.compile(scaled_rows)
for n in map(int, sys.argv[1:]):
    x = random_tensor(4, n)
    rtol, atol = tolerance(torch.float32)
    torch.testing.assert_close(compiled(x), scaled_rows(x), rtol=rtol, atol=atol)
print(kiln.stats()["frames_compiled"])
"""


def _frames_of_a_process(cache, job, sizes):
    import os
    import subprocess
    import sys
    env = dict(os.environ, KILN_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_COMPILE_JOB_ID", None)
    env.pop("TORCH_COMPILE_STICKY_PGO_KEY", None)
    if job:
        env["TORCH_COMPILE_JOB_ID"] = job
    out = subprocess.run([sys.executable, "-c", PROFILE_CHILD, *map(str, sizes)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def test_a_job_remembers_its_dynamic_dims_across_processes(tmp_path):
    """With torch.compiler.config.job_id set, a dim that changed size in one process is symbolic from the first call of
    the next process of that job (one compile, not two); without a job id, or under another job, nothing carries over;
    a profile that cannot be read is ignored."""
    assert _frames_of_a_process(tmp_path, "job-a", [5, 7, 9]) == 2
    assert _frames_of_a_process(tmp_path, "job-a", [11, 13, 6]) == 1
    assert _frames_of_a_process(tmp_path, "job-b", [11, 13]) == 2
    assert _frames_of_a_process(tmp_path, None, [11, 13]) == 2
    profiles = list((tmp_path / "dynamic").glob("*.txt"))
    assert len(profiles) == 2, profiles  # job-a's and job-b's; none without a job
    for p in profiles:
        assert p.read_text().splitlines()[1:] == ["x\t1"], p.read_text()
        p.write_text("not a profile\n")  # its checksum no longer matches either: the entry is dropped
    assert _frames_of_a_process(tmp_path, "job-a", [11, 13]) == 2


# ---- sizes computed where the tracer cannot see ------------------------------------------------------------------
def _upsample(x):
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


def _torch_sizes(x):
    # torch.diff (a narrow of length n - 1), tensor_split (slices at computed bounds), adaptive pooling with a
    # size taken from the input: each computes sizes inside one call the recorder runs whole.
    return torch.diff(x, dim=-1).sum(-1), x.tensor_split(3, -1)[1].sum(-1), F.adaptive_avg_pool1d(x, 3)


@pytest.mark.parametrize("dynamic", [True, None])
@pytest.mark.parametrize("fn,make", [
    (_upsample, lambda n: (random_tensor(1, 2, n, n + 1),)),
    (nn.Upsample(scale_factor=2, mode="nearest"), lambda n: (random_tensor(1, 2, n, n),)),
    (_torch_sizes, lambda n: (random_tensor(2, 3, n),)),
], ids=["interpolate", "upsample_module", "torch_composites"])
def test_sizes_computed_inside_ops_recorded_whole_are_never_baked_in(fresh, dynamic, fn, make):
    # F.interpolate computed its output size from the input's and upsample_bilinear2d recorded it as a literal: the
    # dynamic graph returned the first size's output shape at every later size. Such a size argument (SymInt in
    # ATen's schema) that no traced int explains now specialises the sizes its op reads.
    run_sizes(fn, make, dynamic, sizes=[5, 9, 16, 7])


def _scaled(x):
    # Scales that are small fractions: the output size is floor(size * p / q), a floordiv of the input's symbol.
    return (F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False).sum((2, 3)),
            F.interpolate(x, scale_factor=1.5, mode="nearest"), F.interpolate(x, scale_factor=0.5, mode="bilinear"),
            nn.functional.interpolate(x, scale_factor=(2, 0.75), mode="nearest"))


def test_upsampling_by_a_scale_factor_is_one_dynamic_graph(fresh):
    stats = run_sizes(_scaled, lambda n: (random_tensor(2, 3, n, n + 3),), dynamic=True, sizes=[4, 5, 9, 16, 7, 33])
    assert stats["frames_compiled"] == 1 and stats["recompiles"] == 0, stats
    # A scale that is no small fraction (1/3) keeps specialising: its output sizes recompile per size, never wrong.
    kiln.reset()
    run_sizes(lambda x: F.interpolate(x, scale_factor=1 / 3, mode="nearest"), lambda n: (random_tensor(1, 2, n, n),),
              dynamic=True, sizes=[6, 7, 11])


class _Decoder(nn.Module):
    """A diffusion-UNet-style decoder block: group norms (their N, C and HxW are computed inside the composite) and a
    transposed convolution."""

    def __init__(self):
        super().__init__()
        self.norm1, self.conv = nn.GroupNorm(2, 4), nn.Conv2d(4, 6, 3, padding=1)
        self.norm2, self.up = nn.GroupNorm(3, 6), nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1)

    def forward(self, x):
        return self.up(F.silu(self.norm2(self.conv(F.silu(self.norm1(x))))))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_group_norm_and_transposed_convolutions_keep_one_dynamic_graph(fresh, train):
    torch.manual_seed(0)
    model = _Decoder()
    compiled = kiln.compile(copy.deepcopy(model), dynamic=True)
    for n in (5, 8, 13, 6):
        x = random_tensor(2, 4, n, n + 2)
        if train:
            want, got = model(x), compiled(x)
            want.square().mean().backward()
            got.square().mean().backward()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            for a, b in zip(compiled.parameters(), model.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4)
                a.grad, b.grad = None, None
        else:
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    stats = kiln.stats()
    assert stats["frames_compiled"] == 1 and stats["recompiles"] == 0, stats
