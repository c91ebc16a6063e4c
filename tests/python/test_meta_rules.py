"""kiln's own output-metadata rules (kiln/_meta_rules.py) against eager ATen: for every rule, random shapes,
layouts (permuted, sliced, broadcast, channels-last, size-1 dims with odd strides) and dtypes; the shape,
strides and dtype must equal those of the op's real CPU result. Also: a trace of the seed models' ops does
not import sympy (what the rules are for), and cases outside the rules still reach torch's meta kernels."""
import random
import subprocess
import sys
import os

import pytest
import torch

from kiln import _meta_rules

aten = torch.ops.aten
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _random_layout(rng, shape, dtype):
    """A CPU tensor of `shape` in a random layout: a permutation of a larger buffer, maybe sliced, with odd
    strides for size-1 dims, or channels-last."""
    choice = rng.random()
    if choice < 0.25:
        return torch.randn(shape).to(dtype)
    if choice < 0.35 and len(shape) == 4:
        return torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    perm = list(range(len(shape)))
    rng.shuffle(perm)
    steps = [rng.choice([1, 1, 2]) for _ in shape]
    base_shape = [shape[p] * steps[p] for p in perm]
    base = torch.randn(base_shape).to(dtype)
    index = tuple(slice(None, None, steps[p]) for p in perm)
    view = base[index]
    inverse = [perm.index(d) for d in range(len(shape))]
    view = view.permute(inverse)
    assert list(view.shape) == list(shape)
    if rng.random() < 0.3 and 1 in shape:
        strides = [rng.choice([1, 7, 1000]) if s == 1 else st for s, st in zip(view.shape, view.stride())]
        view = view.as_strided(view.shape, strides)
    return view


def _broadcast_to(rng, shape):
    """A shape that broadcasts to `shape`: some leading dims dropped, some dims set to 1."""
    drop = rng.randint(0, len(shape)) if rng.random() < 0.3 else 0
    return [1 if rng.random() < 0.25 else s for s in shape[drop:]]


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _same(expected, got):
    if isinstance(expected, (tuple, list)):
        assert len(expected) == len(got)
        for e, g in zip(expected, got):
            _same(e, g)
        return
    assert got.device.type == "meta"
    assert (list(got.shape), got.dtype) == (list(expected.shape), expected.dtype)
    assert list(got.stride()) == list(expected.stride()), (list(got.stride()), list(expected.stride()))


def _check(func, args, kwargs=None):
    kwargs = kwargs or {}
    expected = func(*args, **kwargs)
    meta_args = [_meta(a) if isinstance(a, torch.Tensor) else a for a in args]
    got = _meta_rules.infer(func, meta_args, {k: _meta(v) if isinstance(v, torch.Tensor) else v
                                              for k, v in kwargs.items()})
    assert got is not None, f"{func} has a rule but returned None for {[getattr(a, 'shape', a) for a in args]}"
    _same(expected, got)


UNARY = [aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
         aten.exp.default, aten.neg.default, aten.abs.default, aten.erf.default, aten.hardswish.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
          aten.minimum.default, aten.lt.Tensor, aten.eq.Tensor]
SAME_SHAPE = [aten.gelu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default]


@pytest.mark.parametrize("seed", range(6))
def test_pointwise_layouts_match_eager(seed):
    rng = random.Random(seed)
    for _ in range(120):
        ndim = rng.randint(1, 5)
        shape = [rng.choice([1, 2, 3, 5, 8]) for _ in range(ndim)]
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        x = _random_layout(rng, shape, dtype)
        func = rng.choice(UNARY + BINARY + SAME_SHAPE)
        if func in UNARY:
            _check(func, [x])
            continue
        if func in SAME_SHAPE:
            _check(func, [_random_layout(rng, shape, dtype), x])
            continue
        other_shape = _broadcast_to(rng, shape) if rng.random() < 0.5 else shape
        y = _random_layout(rng, other_shape, dtype) if other_shape else torch.randn(()).to(dtype)
        args = [x, y] if rng.random() < 0.5 else [y, x]
        if args[0].dim() == 0:
            args = [x, y]
        _check(func, args)


def test_pointwise_with_python_numbers_and_zero_dim_tensors():
    x = torch.randn(4, 3).t()
    _check(aten.add.Tensor, [x, 1])
    _check(aten.mul.Tensor, [x, 0.5])
    _check(aten.add.Tensor, [x, torch.tensor(2.0, dtype=torch.float64)])
    _check(aten.add.Tensor, [x, torch.tensor(2)], {"alpha": 3})
    _check(aten.gt.Scalar, [x, 0.0])
    _check(aten.clamp.default, [x, -1.0, 1.0])
    _check(aten.pow.Tensor_Scalar, [x, 2])
    _check(aten.gelu.default, [x], {"approximate": "tanh"})
    _check(aten.rsub.Scalar, [x, 1.0])


def test_matmuls_reductions_softmax_layer_norm_match_eager():
    rng = random.Random(0)
    for _ in range(20):
        n, k, m = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        a, b = _random_layout(rng, [n, k], torch.float32), _random_layout(rng, [k, m], torch.float32)
        _check(aten.mm.default, [a, b])
        _check(aten.addmm.default, [_random_layout(rng, rng.choice([[m], [n, m], [1, m]]), torch.float32), a, b])
        _check(aten.bmm.default, [_random_layout(rng, [3, n, k], torch.float32),
                                  _random_layout(rng, [3, k, m], torch.float32)])
        x = _random_layout(rng, [n, k, m, 2], torch.float32)
        for func in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default):
            dims = rng.sample(range(-4, 4), rng.randint(1, 2))
            if len({d % 4 for d in dims}) != len(dims):
                continue
            _check(func, [x, dims, rng.random() < 0.5])
        _check(aten.sum.dim_IntList, [x, None])
        _check(aten._softmax.default, [x, rng.randint(-4, 3), False])
        w, bias = torch.randn(m, 2), torch.randn(m, 2)
        _check(aten.native_layer_norm.default, [x, [m, 2], w, bias, 1e-5])
        _check(aten.native_layer_norm.default, [x, [2], None, None, 1e-5])


def test_unsafe_view_of_contiguous_inputs_matches_eager():
    x = torch.randn(4, 6, 5)
    for size in ([24, 5], [-1, 5], [4, -1], [120], [2, 2, 3, 10], [1, -1, 1]):
        _check(aten._unsafe_view.default, [x, size])
    meta = torch.empty(4, 6, 5, device="meta")
    assert _meta_rules.infer(aten._unsafe_view.default, [meta.transpose(0, 1), [24, 5]], {}) is None  # not contiguous
    assert _meta_rules.infer(aten._unsafe_view.default, [meta, [7, -1]], {}) is None                  # torch raises


def test_which_ops_reach_python_meta_kernels():
    from kiln._fake import _has_python_meta
    assert _has_python_meta("aten::add.Tensor") and _has_python_meta("aten::mm.default")
    assert not _has_python_meta("aten::t.default") and not _has_python_meta("aten::transpose.int")


def test_cases_outside_the_rules_return_none():
    x = torch.empty(4, 3, device="meta")
    assert _meta_rules.infer(aten.add.Tensor, [x.int(), x.int()], {}) is None        # integers: torch decides
    assert _meta_rules.infer(aten.add.Tensor, [x, x.double()], {}) is None           # mixed dtypes
    assert _meta_rules.infer(aten.add.Tensor, [x, torch.empty(5, device="meta")], {}) is None  # not broadcastable
    assert _meta_rules.infer(aten.gelu.default, [x], {"approximate": "bad"}) is None  # torch raises the error
    assert _meta_rules.infer(aten.mm.default, [x, x], {}) is None                    # bad inner dims
    assert _meta_rules.infer(aten.cumsum.default, [x, 0], {}) is None                # no rule
    assert _meta_rules.infer(aten.mean.dim, [x, [0, 0]], {}) is None                 # repeated dim
    assert _meta_rules.infer(aten.add.Tensor, [torch.empty(0, 3, device="meta"), x[:1]], {}) is None  # empty


def test_seed_model_trace_does_not_import_sympy():
    """A new process that compiles and runs the mlp and transformer6 seed models never imports sympy
    (torch's elementwise meta kernels would, on their first call)."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import torch, kiln, seed_models\n"
        "for name in ('mlp', 'transformer6'):\n"
        "    model, x, _ = seed_models.make(name, 'cpu')\n"
        "    model = model.eval()\n"
        "    if name == 'transformer6':\n"
        "        model, x = model[:1], x[:, :8]\n"
        "    with torch.no_grad():\n"
        "        expected = model(x)\n"
        "        got = kiln.compile(model)(x)\n"
        "    assert torch.allclose(got, expected, rtol=1.3e-5, atol=1e-5), (got - expected).abs().max()\n"
        # (torch.testing.assert_close would import sympy itself, through torch.distributed)
        "assert kiln.stats()['frames_compiled'] >= 2, kiln.stats()\n"
        "print('sympy' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    ) % os.path.join(REPO, "benchmarks")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"], out.stdout
