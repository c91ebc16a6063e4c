"""kiln's symbolic shape rules (csrc/graph/shape_rules*.cpp, through kiln._C.shape_rule) against PyTorch.

Every case builds real CPU tensors of random sizes (primes, sizes that are not multiples of 8) in random layouts
(permuted, sliced with offsets, expanded, channels-last, size-1 dims with odd strides), describes each with symbolic
sizes, strides and storage offset, and evaluates the rule with the symbols bound to the concrete sizes. Its
answer must equal the op's eager result (torch's meta kernel for CUDA-only kernels) in sizes, strides, storage
offset and dtype, and every assumption the rule recorded must hold for those sizes.

Each case runs three ways: all sizes concrete (the rule must answer), duck-sized (one symbol per distinct size >=
2, as PyTorch names them) and fresh (one symbol per dim >= 2: equalities become assumptions). Symbolic runs may
refuse where a layout decision cannot be proven; they must never answer wrongly.
"""
import random

import pytest
import torch

import kiln._C as C

aten = torch.ops.aten
CODES = C._enum_codes()
DTYPE = CODES["dtypes"]
FORMAT = CODES["memory_formats"]
MODES = ("concrete", "duck", "fresh")


class Space:
    """How sizes become symbols in one run."""

    def __init__(self, mode):
        self.mode, self.bindings, self.count = mode, {}, 0

    def size(self, value):
        if value < 2 or self.mode == "concrete":
            return str(value)
        if self.mode == "duck":
            name = f"d{value}"
        else:
            name, self.count = f"f{self.count}", self.count + 1
        self.bindings[name] = value
        return name


def _product(factors):
    factors = [f for f in factors if f != "1"]
    return "*".join(f"({f})" for f in factors) if factors else "1"


class Sym:
    """A symbolic int argument: `value` for torch, `text(space)` for kiln (sizes of the case's dims)."""

    def __init__(self, value, dims):
        self.value, self.dims = value, dims  # dims: concrete sizes whose product (times the rest) it is

    def text(self, space):
        rest = self.value
        names = []
        for d in self.dims:
            rest //= d
            names.append(space.size(d))
        if rest != 1:
            names.append(str(rest))
        return _product(names)


class Case:
    """Tensors made for one op call, each remembered with its layout recipe (so each run can name its sizes)."""

    def __init__(self, rng):
        self.rng, self.recipes = rng, {}

    def tensor(self, shape, dtype=torch.float32, kind=None):
        rng = self.rng
        shape = list(shape)
        kinds = ["contiguous", "contiguous", "permuted", "sliced", "odd"]
        if len(shape) == 4:
            kinds.append("channels_last")
        if any(s >= 2 for s in shape):
            kinds.append("expanded")
        kind = kind or rng.choice(kinds)
        if kind == "expanded":
            d = rng.choice([i for i, s in enumerate(shape) if s >= 2])
            small = shape[:d] + [1] + shape[d + 1:]
            base = self.tensor(small, dtype, rng.choice(["contiguous", "permuted", "sliced"]))
            t = base.expand(shape)
            self.recipes[id(t)] = ("expanded", self.recipes[id(base)], d, shape[d])
            return t
        if kind == "channels_last" and len(shape) == 4:
            t = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last).copy_(torch.randn(shape))
            self.recipes[id(t)] = ("channels_last", shape)
            return t
        ndim = len(shape)
        perm = list(range(ndim))
        if kind in ("permuted", "sliced"):
            rng.shuffle(perm)
        steps = [rng.choice([1, 2]) if kind == "sliced" else 1 for _ in shape]
        starts = [rng.choice([0, 1]) if kind == "sliced" else 0 for _ in shape]
        base = torch.randn([shape[p] * steps[p] + starts[p] for p in perm]).to(dtype)
        view = base[tuple(slice(starts[p], starts[p] + shape[p] * steps[p], steps[p]) for p in perm)]
        view = view.permute([perm.index(d) for d in range(ndim)])
        odd = {}
        if kind == "odd" and 1 in shape:
            odd = {d: rng.choice([1, 7, 1000]) for d, s in enumerate(shape) if s == 1}
            view = view.as_strided(view.shape, [odd.get(d, st) for d, st in enumerate(view.stride())],
                                   view.storage_offset())
        assert list(view.shape) == shape
        self.recipes[id(view)] = ("strided", shape, perm, steps, starts, odd)
        return view

    def describe(self, t, space):
        """{'sizes', 'strides', 'offset', 'dtype'} of t as expression text over `space`'s symbols."""
        recipe = self.recipes[id(t)]
        desc = self._layout(recipe, space)
        desc["dtype"] = DTYPE[t.dtype]
        return desc

    def _layout(self, recipe, space):
        if recipe[0] == "expanded":
            _, inner, d, size = recipe
            desc = self._layout(inner, space)
            desc["sizes"][d], desc["strides"][d] = space.size(size), "0"
            return desc
        if recipe[0] == "channels_last":
            sizes = [space.size(s) for s in recipe[1]]
            strides, acc = [None] * 4, []
            for d in (1, 3, 2, 0):
                strides[d] = _product(acc)
                acc.append(sizes[d])
            return {"sizes": sizes, "strides": strides, "offset": "0"}
        _, shape, perm, steps, starts, odd = recipe
        sizes = [space.size(s) for s in shape]
        base_sizes = [f"({sizes[p]})*{steps[p]}+{starts[p]}" for p in perm]
        base_strides = [_product(base_sizes[j + 1:]) for j in range(len(perm))]
        strides, offset = [None] * len(shape), []
        for j, p in enumerate(perm):
            strides[p] = f"{steps[p]}*({base_strides[j]})"
            offset.append(f"{starts[p]}*({base_strides[j]})")
        for d, st in odd.items():
            strides[d] = str(st)
        return {"sizes": sizes, "strides": strides, "offset": " + ".join(offset) or "0"}


def _schema_args(func, args, kwargs):
    """The full schema argument list, defaults filled, as graph nodes hold it."""
    full = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            full.append(args[i])
        elif a.name in kwargs:
            full.append(kwargs[a.name])
        elif a.has_default_value():
            value = a.default_value  # (memory formats and dtypes come back as their codes)
            full.append({"memory_format": value} if a.name == "memory_format" and isinstance(value, int) else value)
        else:
            full.append(None)
    return full


def _to_kiln(value, case, space):
    if isinstance(value, torch.Tensor):
        return case.describe(value, space)
    if isinstance(value, Sym):
        return {"expr": value.text(space)} if space.mode != "concrete" else value.value
    if isinstance(value, torch.dtype):
        return {"dtype": DTYPE[value]}
    if isinstance(value, torch.memory_format):
        return {"memory_format": FORMAT[value]}
    if isinstance(value, torch.layout):
        return {"layout": CODES["layouts"][value]}
    if isinstance(value, torch.device):
        return {"device": CODES["device_types"][value.type]}
    if isinstance(value, (list, tuple)):
        return [_to_kiln(v, case, space) for v in value]
    return value  # (a {"memory_format": code} dict passes as it is)


def _to_torch(value):
    if isinstance(value, Sym):
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_torch(v) for v in value)
    return value


STATS = {"answered": 0, "refused": 0}


def _run(func, case, args, kwargs=None, *, expected=None, must_answer=True):
    """Checks kiln's rule for func(*args, **kwargs) in every mode; returns how many symbolic modes answered."""
    kwargs = kwargs or {}
    if expected is None:
        expected = func(*_to_torch(args), **{k: _to_torch(v) for k, v in kwargs.items()})
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    name = f"aten::{func._schema.name.split('::')[1]}.{func._overloadname}"
    answered = 0
    for mode in MODES:
        space = Space(mode)
        full = [_to_kiln(a, case, space) for a in _schema_args(func, args, kwargs)]
        got = C.shape_rule(name, full, space.bindings)
        if not got["has_rule"]:
            assert mode != "concrete" or not must_answer, f"{name}: {got['reason']}"
            STATS["refused"] += 1
            continue
        STATS["answered"] += 1
        answered += mode != "concrete"
        for a in got["assumptions"]:
            assert a["holds"], f"{name} ({mode}) assumed {a['text']} ({a['reason']}), false here: {space.bindings}"
        assert len(got["outputs"]) == len(expected), name
        for e, g in zip(expected, got["outputs"]):
            if e is None:
                assert g is None, name
                continue
            text = f"{name} ({mode}): {g['text']} at {space.bindings}"
            assert g["sizes_value"] == list(e.shape), text
            assert g["strides_value"] == list(e.stride()), (text, list(e.stride()))
            assert g["offset_value"] == e.storage_offset(), text
            assert g["dtype"] == DTYPE[e.dtype], text
    return answered


def _shape(rng, ndim, low=1):
    return [rng.choice([low, 2, 3, 5, 7, 8, 11, 13][0 if low == 1 else 1:]) for _ in range(ndim)]


def _broadcast_to(rng, shape):
    drop = rng.randint(0, len(shape)) if rng.random() < 0.3 else 0
    return [1 if rng.random() < 0.25 else s for s in shape[drop:]]


UNARY = [aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
         aten.exp.default, aten.neg.default, aten.abs.default, aten.erf.default, aten.hardswish.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
          aten.minimum.default, aten.lt.Tensor, aten.eq.Tensor]
SAME_SHAPE = [aten.gelu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default]


@pytest.mark.parametrize("seed", range(4))
def test_pointwise(seed):
    rng = random.Random(seed)
    answered = 0
    for _ in range(60):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        x = case.tensor(shape, dtype)
        func = rng.choice(UNARY + BINARY + SAME_SHAPE + ["where", "addcmul", "scalar"])
        if func in UNARY:
            answered += _run(func, case, [x])
        elif func in SAME_SHAPE:
            answered += _run(func, case, [case.tensor(shape, dtype), x])
        elif func == "where":
            cond = case.tensor(_broadcast_to(rng, shape), torch.bool)
            answered += _run(aten.where.self, case, [cond, x, case.tensor(_broadcast_to(rng, shape), dtype)])
        elif func == "addcmul":
            answered += _run(aten.addcmul.default, case, [x, case.tensor(_broadcast_to(rng, shape), dtype),
                                                          case.tensor(shape, dtype)], {"value": 0.5})
        elif func == "scalar":
            answered += _run(rng.choice([aten.add.Tensor, aten.gt.Scalar, aten.mul.Tensor]), case, [x, 2])
        else:
            y = case.tensor(_broadcast_to(rng, shape) if rng.random() < 0.5 else shape, dtype)
            answered += _run(func, case, [x, y] if rng.random() < 0.5 else [y, x])
    assert answered > 30  # symbolic runs answer most layouts


def test_integer_pointwise_with_broadcasting():
    # integer arithmetic has no TensorIterator layout in kiln's rules: contiguous operands, broadcast or not, give a
    # contiguous result (T5's relative positions: an int64 [1, n] row less a [1, 1] offset)
    rng = random.Random(11)
    answered = 0
    for _ in range(40):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        x = case.tensor(shape, torch.int64, kind="contiguous")
        y = case.tensor([1 if rng.random() < 0.4 else s for s in shape], torch.int64, kind="contiguous")
        func = rng.choice([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.minimum.default,
                           aten.maximum.default, aten.eq.Tensor, aten.lt.Tensor, "where"])
        # (a 4-d operand that is also channels-last contiguous, one with size-1 dims, is refused: may not answer)
        if func == "where":
            condition = case.tensor([1 if rng.random() < 0.4 else s for s in shape], torch.bool, kind="contiguous")
            answered += _run(aten.where.self, case, [condition, x, y], must_answer=False)
            continue
        answered += _run(func, case, [x, y] if rng.random() < 0.5 else [y, x], must_answer=False)
    assert answered > 20
    # Integer arithmetic over any layout (transformers' position ids: an expanded int64 row less 1) takes
    # TensorIterator's layout, as eager's kernels do (sizes of 2 or more: a size-1 dim's stride is its own story).
    for _ in range(30):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4), low=2)
        x, y = case.tensor(shape, torch.int64), case.tensor(shape[rng.randint(0, len(shape) - 1):], torch.int64)
        func = rng.choice([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.maximum.default])
        assert _run(func, case, [x, y] if rng.random() < 0.5 else [y, x]) > 0
        assert _run(rng.choice([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor]), case, [x, 2]) > 0
    # An integer receiver takes int tensors of its dtype that broadcast to it (positions += offsets).
    for _ in range(8):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 3), low=2)
        x, y = case.tensor(shape, torch.int64, "contiguous"), case.tensor(shape[rng.randint(0, len(shape) - 1):], torch.int64)
        assert _run(rng.choice([aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor]), case, [x, y]) > 0


def test_pointwise_in_place_dropout_and_like_factories():
    rng = random.Random(1)
    for _ in range(40):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        x = case.tensor(shape, kind=rng.choice(["contiguous", "permuted", "sliced", "odd"]))
        y = case.tensor(_broadcast_to(rng, shape))
        _run(aten.add_.Tensor, case, [x.clone() if False else x, y], expected=x)
        _run(aten.relu_.default, case, [x], expected=x)
        for func, extra in ((aten.empty_like.default, []), (aten.zeros_like.default, []),
                            (aten.full_like.default, [3.0]), (aten.clone.default, [])):
            fmt = rng.choice([None, torch.contiguous_format, torch.preserve_format])
            kwargs = {} if fmt is None else {"memory_format": fmt}
            _run(func, case, [x] + extra, kwargs)
        _run(aten._to_copy.default, case, [x], {"dtype": torch.float64})
        _run(aten.contiguous.default, case, [x], expected=x.contiguous())
        torch.manual_seed(0)
        # dropout on inputs whose CPU and CUDA layouts differ is refused: not checked here
        _run(aten.native_dropout.default, case, [x, 0.5, True], must_answer=False)
    case = Case(rng)
    x = case.tensor([2, 3, 5, 7], kind="channels_last")
    _run(aten.clone.default, case, [x], {"memory_format": torch.channels_last})
    _run(aten.empty_like.default, case, [x])


def test_reductions_softmax_layer_norm_and_matmuls():
    rng = random.Random(2)
    for _ in range(30):
        case = Case(rng)
        n, k, m = _shape(rng, 3)
        x = case.tensor([n, k, m, 2])
        for func in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default):
            dims = rng.sample(range(-4, 4), rng.randint(1, 2))
            if len({d % 4 for d in dims}) == len(dims):
                _run(func, case, [x, dims, rng.random() < 0.5])
        _run(aten.sum.dim_IntList, case, [x, None])
        _run(aten.sum.default, case, [x])
        _run(aten.mean.default, case, [x])
        _run(aten._softmax.default, case, [x, rng.randint(-4, 3), False])
        _run(aten._log_softmax.default, case, [x, rng.randint(-4, 3), False])
        _run(aten._safe_softmax.default, case, [x, rng.randint(-4, 3)])
        w, bias = case.tensor([m, 2], kind="contiguous"), case.tensor([m, 2], kind="contiguous")
        _run(aten.native_layer_norm.default, case, [x, [Sym(m, [m]), 2], w, bias, 1e-5])
        _run(aten.native_layer_norm.default, case, [x, [2], None, None, 1e-5])
        a, b = case.tensor([n, k]), case.tensor([k, m])
        _run(aten.mm.default, case, [a, b])
        _run(aten.addmm.default, case, [case.tensor(rng.choice([[m], [n, m], [1, m]])), a, b])
        _run(aten.bmm.default, case, [case.tensor([3, n, k]), case.tensor([3, k, m])])
        _run(aten.matmul.default, case, [case.tensor([2, n, k]), b])
        _run(aten.matmul.default, case, [case.tensor([2, n, k]), case.tensor([2, k, m])])
        _run(aten.matmul.default, case, [a, case.tensor([k])])
        _run(aten.linear.default, case, [case.tensor([2, n, k]), case.tensor([m, k]), case.tensor([m])])


def test_views():
    rng = random.Random(3)
    for _ in range(40):
        case = Case(rng)
        shape = _shape(rng, rng.randint(2, 4))
        x = case.tensor(shape)
        c = case.tensor(shape, kind="contiguous")
        merged = Sym(shape[0] * shape[1], shape[:2])
        for func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            _run(func, case, [c, [merged, -1] if len(shape) > 2 else [merged]])
            _run(func, case, [c, [-1]])
            _run(func, case, [c, [Sym(shape[0], shape[:1]), -1]])
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        _run(aten.permute.default, case, [x, perm])
        _run(aten.transpose.int, case, [x, 0, -1])
        _run(aten.t.default, case, [case.tensor(shape[:2])])
        _run(aten.unsqueeze.default, case, [x, rng.randint(-len(shape) - 1, len(shape))])
        _run(aten.squeeze.dim, case, [x, rng.randint(-len(shape), len(shape) - 1)])
        _run(aten.squeeze.dims, case, [x, [0, -1]])
        _run(aten.squeeze.default, case, [x])
        ones = case.tensor([1 if rng.random() < 0.5 else s for s in shape])
        _run(aten.expand.default, case, [ones, [Sym(s, [s]) for s in shape]])
        _run(aten.expand.default, case, [ones, [4] + [-1] * len(shape)])
        dim = rng.randint(0, len(shape) - 1)
        size = shape[dim]
        for start, end, step in ((0, None, 1), (1, 9223372036854775807, 2), (-2, None, 1), (0, -1, 1),
                                 (rng.randint(0, 3), rng.randint(0, 20), rng.choice([1, 2, 3])), (-20, 20, 1)):
            _run(aten.slice.Tensor, case, [x, dim, start, end, step])
        _run(aten.slice.Tensor, case, [x, dim, Sym(size, [size]), None, 1])
        _run(aten.select.int, case, [x, dim, rng.randint(-size, size - 1)])
        _run(aten.select.int, case, [x, dim, -1])
        start = rng.randint(0, size - 1)
        _run(aten.narrow.default, case, [x, dim, start, rng.randint(0, size - start)])
        split = rng.randint(1, 4)
        _run(aten.split.Tensor, case, [x, split, dim], must_answer=True) if size <= split or True else None
        _run(aten.split_with_sizes.default, case, [x, [1, size - 1], dim])
        _run(aten.chunk.default, case, [x, rng.randint(1, 4), dim])
        _run(aten.unbind.int, case, [x, dim])
        _run(aten.alias.default, case, [x])


def test_cat_and_stack():
    rng = random.Random(4)
    for _ in range(40):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        dim = rng.randint(-len(shape), len(shape) - 1)
        parts = []
        for _ in range(rng.randint(1, 3)):
            s = list(shape)
            s[dim] = rng.choice([1, 2, 3, 5])
            parts.append(case.tensor(s))
        _run(aten.cat.default, case, [parts, dim])
        same = [case.tensor(shape) for _ in range(rng.randint(2, 3))]
        _run(aten.stack.default, case, [same, rng.randint(-len(shape) - 1, len(shape))], must_answer=False)
    case = Case(rng)
    cl = [case.tensor([2, 3, 5, 7], kind="channels_last") for _ in range(2)]
    _run(aten.cat.default, case, [cl, 1])


def test_embedding_convolution_pooling_batch_norm():
    rng = random.Random(5)
    for _ in range(20):
        case = Case(rng)
        n, c, o, h, w = rng.randint(1, 3), rng.choice([2, 3, 4]), rng.choice([2, 5]), rng.randint(5, 13), rng.randint(5, 13)
        weight = case.tensor([11, c * 2], kind="contiguous")
        indices = torch.randint(0, 11, (n, h))
        case.recipes[id(indices)] = ("strided", [n, h], [0, 1], [1, 1], [0, 0], {})
        _run(aten.embedding.default, case, [weight, indices])
        x = case.tensor([n, c, h, w], kind="contiguous")
        k = rng.choice([1, 3])
        for stride, padding, dilation in (([1, 1], [0, 0], [1, 1]), ([2, 2], [1, 1], [1, 1]), ([2, 1], [1, 0], [2, 1])):
            _run(aten.convolution.default, case, [x, case.tensor([o, c, k, k], kind="contiguous"), case.tensor([o]),
                                                  stride, padding, dilation, False, [0, 0], 1])
        x = case.tensor([n, c, h, w], kind=rng.choice(["contiguous", "channels_last", "permuted"]))
        for ceil_mode in (False, True):
            _run(aten.max_pool2d_with_indices.default, case, [x, [3, 3], [2, 2], [1, 1], [1, 1], ceil_mode])
            _run(aten.avg_pool2d.default, case, [x, [2, 2], [2, 2], [0, 0], ceil_mode])
            _run(aten.avg_pool2d.default, case, [x, [3, 3], [2, 2], [1, 1], ceil_mode])
            _run(aten.avg_pool2d.default, case, [x, [2, 2], [2, 2], [1, 1], ceil_mode])  # (ceil_mode drops a window)
            _run(aten.max_pool2d_with_indices.default, case, [x, [2, 2], [3, 3], [1, 1], [1, 1], ceil_mode])
        _run(aten._adaptive_avg_pool2d.default, case, [x, [rng.randint(1, 4), rng.randint(1, 4)]])
        x = case.tensor([n + 1, c, h, w], kind=rng.choice(["contiguous", "channels_last"]))
        params = [case.tensor([c], kind="contiguous") for _ in range(4)]
        _run(aten.native_batch_norm.default, case, [x] + params + [True, 0.1, 1e-5], must_answer=False)
        _run(aten._native_batch_norm_legit_no_training.default, case, [x] + params + [0.1, 1e-5],
             expected=aten._native_batch_norm_legit_no_training.default(
                 *[torch.empty_strided(t.shape, t.stride(), device="meta") for t in [x] + params], 0.1, 1e-5),
             must_answer=False)


def test_attention_kernels():
    rng = random.Random(6)
    for _ in range(10):
        case = Case(rng)
        b, heads, length, kv, dim = rng.randint(1, 3), rng.randint(1, 4), rng.choice([3, 7, 33]), rng.choice([5, 8]), 8
        q, k, v = (case.tensor(s, kind=rng.choice(["contiguous", "permuted"]))
                   for s in ([b, heads, length, dim], [b, heads, kv, dim], [b, heads, kv, dim]))
        _run(aten._scaled_dot_product_flash_attention_for_cpu.default, case, [q, k, v, 0.0, rng.random() < 0.5])
        meta = [torch.empty_strided(t.shape, t.stride(), device="meta") for t in (q, k, v)]
        _run(aten._scaled_dot_product_efficient_attention.default, case, [q, k, v, None, True],
             expected=aten._scaled_dot_product_efficient_attention.default(*meta, None, True))


def test_backward_ops():
    rng = random.Random(7)
    for _ in range(15):
        case = Case(rng)
        n, k, m = _shape(rng, 3)
        x, grad = case.tensor([n, k, m]), case.tensor([n, k, m])
        w, bias = case.tensor([m], kind="contiguous"), case.tensor([m], kind="contiguous")
        out, mean, rstd = torch.native_layer_norm(x, [m], w, bias, 1e-5)
        case.recipes[id(mean)] = case.recipes[id(rstd)] = ("strided", [n, k, 1], [0, 1, 2], [1] * 3, [0] * 3, {})
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            _run(aten.native_layer_norm_backward.default, case, [grad, x, [m], mean, rstd, w, bias, mask])
        y = case.tensor([n, k, m])
        _run(aten._softmax_backward_data.default, case, [grad, y, rng.randint(-3, 2), torch.float32])
        sizes = [n, k, m, rng.randint(2, 4)]
        _run(aten.select_backward.default, case, [case.tensor([n, k, m]), sizes, 3, rng.randint(-sizes[3], sizes[3] - 1)])


def test_rules_answer_symbolically_for_contiguous_inputs():
    # The everyday case of dynamic shapes: contiguous inputs, duck-sized symbols. The rules must not refuse.
    rng = random.Random(8)
    case = Case(rng)
    x, y = case.tensor([3, 5, 7], kind="contiguous"), case.tensor([7], kind="contiguous")
    space = Space("duck")
    for func, args in ((aten.add.Tensor, [x, y]), (aten.view.default, [x, [Sym(15, [3, 5]), -1]]),
                       (aten.transpose.int, [x, 0, 1]), (aten.sum.dim_IntList, [x, [1], True]),
                       (aten.mm.default, [case.tensor([3, 5], kind="contiguous"), case.tensor([5, 7], kind="contiguous")])):
        full = [_to_kiln(a, case, space) for a in _schema_args(func, args, {})]
        name = f"aten::{func._schema.name.split('::')[1]}.{func._overloadname}"
        got = C.shape_rule(name, full, space.bindings)
        assert got["has_rule"], got["reason"]
        assert not got["assumptions"], got["assumptions"]
    got = C.shape_rule("aten::view.default", [{"sizes": ["a", "b"], "strides": ["b", 1], "dtype": 6}, [-1, 4]],
                       {"a": 3, "b": 8})
    assert got["outputs"][0]["sizes"] == ["floordiv(a*b, 4)", "4"] and got["assumptions"][0]["text"] == "a*b % 4 == 0"
    got = C.shape_rule("aten::add.Tensor", [{"sizes": ["a"], "strides": [1], "dtype": 6},
                                            {"sizes": ["b"], "strides": [1], "dtype": 6}, 1], {"a": 3, "b": 3})
    assert [a["text"] for a in got["assumptions"]] == ["a == b"]
    assert not C.shape_rule("aten::no_such_op.default", [], {})["has_rule"]


# ---- rules whose reference is torch's meta kernel (what the recorder records) ----------------------------------
def _metas(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_metas(v) for v in value)
    return value


def _run_meta(func, case, args, kwargs=None, **options):
    """_run with torch's meta kernel's answer as the expected one."""
    kwargs = kwargs or {}
    expected = func(*_metas(_to_torch(args)), **{k: _metas(_to_torch(v)) for k, v in kwargs.items()})
    return _run(func, case, args, kwargs, expected=expected, **options)


def _dims(rng, ndim, count):
    return [d - ndim * rng.randint(0, 1) for d in rng.sample(range(ndim), min(count, ndim))]


def _sym(value):
    return Sym(value, [value]) if value >= 2 else value


def test_factories():
    rng = random.Random(20)
    for _ in range(15):
        case = Case(rng)
        n, m = rng.choice([2, 3, 5, 7, 11]), rng.choice([1, 2, 4, 6])
        sizes = [_sym(n), m]
        for dtype in (None, torch.float32, torch.float64, torch.bfloat16, torch.long, torch.bool):
            kw = {} if dtype is None else {"dtype": dtype}
            for func in (aten.zeros.default, aten.ones.default, aten.empty.memory_format):
                _run(func, case, [sizes], kw)
            _run(aten.full.default, case, [sizes, rng.choice([2, 2.5, True])], kw)
        _run(aten.full.default, case, [sizes, rng.choice([2, 2.5, True])])
        for func in (aten.randn.default, aten.rand.default):
            _run(func, case, [sizes], {"dtype": rng.choice([torch.float32, torch.float64])})
        _run(aten.empty.memory_format, case, [[n, 3, m, 5]], {"memory_format": torch.channels_last})
        x = case.tensor([n, m], rng.choice([torch.float32, torch.float64, torch.long]))
        for func in (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default):
            _run(func, case, [x, sizes], rng.choice([{}, {"dtype": torch.float64}]))
        _run(aten.new_full.default, case, [x, sizes, 3])
        _run(aten.scalar_tensor.default, case, [rng.choice([3, 2.5, True])])
        _run(aten.scalar_tensor.default, case, [3], {"dtype": torch.long})
        start, step = rng.randint(-3, n - 1), rng.choice([1, 2, 3, -1, -2])
        _run(aten.arange.default, case, [_sym(n)])
        _run(aten.arange.default, case, [_sym(n)], {"dtype": rng.choice([torch.float32, torch.int32])})
        _run(aten.arange.start, case, [start, _sym(n)])
        _run(aten.arange.start_step, case, [start, _sym(n), step] if step > 0 else [_sym(n), start, step])
        _run(aten.arange.start_step, case, [0.5, n, 0.25])  # a float step: pinned (refused without hints)
        _run(aten.arange.start_step, case, [0, _sym(n), 2.0], {"dtype": torch.float64})
        _run(aten.arange.start, case, [n, n])  # (empty: concrete only)


def test_arange_of_symbolic_bounds():
    got = C.shape_rule("aten::arange.start_step", [{"expr": "a"}, {"expr": "b"}, 3, None, None, None, None],
                       {"a": 2, "b": 9})
    assert got["outputs"][0]["sizes_value"] == [3] and got["outputs"][0]["dtype"] == DTYPE[torch.long]
    assert "floordiv" in got["outputs"][0]["sizes"][0]  # (ceil((b - a) / 3), simplified)
    assert [a["text"] for a in got["assumptions"]] == ["a < b"]
    assert not C.shape_rule("aten::arange.start_step", [0, {"expr": "b"}, 0.5, None, None, None, None],
                            {"b": 9})["has_rule"]  # (a float step pins b: only with the capture's hints)


def test_indexing():
    rng = random.Random(21)
    for _ in range(40):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.long])
        x = case.tensor(shape, dtype)
        ndim = len(shape)
        positions = sorted(rng.sample(range(ndim), rng.randint(1, ndim)))
        index_shape = _shape(rng, rng.randint(1, 2))
        indices = [None] * (positions[-1] + 1)
        for p in positions:
            indices[p] = case.tensor(_broadcast_to(rng, index_shape) if rng.random() < 0.5 else index_shape,
                                     rng.choice([torch.long, torch.int32]))
        _run_meta(aten.index.Tensor, case, [x, indices])
        dim = rng.randint(-ndim, ndim - 1)
        r = rng.choice([1, 2, 3, 5])
        _run_meta(aten.index_select.default, case, [x, dim, case.tensor([r], torch.long)])
        index = case.tensor([rng.randint(1, s) for s in shape], torch.long)
        _run_meta(aten.gather.default, case, [x, dim, index])
        src = case.tensor(shape, dtype)
        _run_meta(aten.scatter.src, case, [x, dim, index, src])
        _run_meta(aten.scatter.value, case, [x, dim, index, 2])
        _run_meta(aten.scatter_add.default, case, [x, dim, index, src])
        source_shape = list(shape)
        source_shape[dim] = r
        _run_meta(aten.index_add.default, case, [x, dim, case.tensor([r], torch.long), case.tensor(source_shape, dtype)],
                  must_answer=1 not in shape)
        _run_meta(aten.index_put.default, case, [x, [case.tensor([r], torch.long)], case.tensor([], dtype), False],
                  must_answer=1 not in shape)
        mask = case.tensor(_broadcast_to(rng, shape), torch.bool)
        _run_meta(aten.masked_fill.Scalar, case, [x, mask, 2], must_answer=1 not in shape)
        _run_meta(aten.masked_fill.Tensor, case, [x, mask, case.tensor([], dtype)], must_answer=1 not in shape)
        n, k = rng.choice([1, 2, 5]), rng.choice([2, 3, 7])
        grad, ids = case.tensor([n, k, 6], rng.choice([torch.float32, torch.float64])), case.tensor([n, k], torch.long)
        _run_meta(aten.embedding_dense_backward.default, case, [grad, ids, 11, -1, False])


def test_statistics_and_reductions():
    rng = random.Random(22)
    floating = [torch.float32, torch.float64, torch.bfloat16]
    for _ in range(30):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4), low=2)
        ndim = len(shape)
        x = case.tensor(shape, rng.choice(floating))
        i = case.tensor(shape, rng.choice([torch.long, torch.int32, torch.uint8]))
        b = case.tensor(shape, torch.bool)
        dims, dim, keepdim = _dims(rng, ndim, rng.randint(1, 2)), rng.randint(-ndim, ndim - 1), rng.random() < 0.5
        for func in (aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction):
            _run_meta(func, case, [x, rng.choice([dims, None])], {"correction": rng.choice([0, 1]), "keepdim": keepdim})
        for t in (x, i, b):
            _run_meta(aten.prod.dim_int, case, [t, dim, keepdim])
            _run_meta(aten.cumsum.default, case, [t, dim])
            _run_meta(aten.any.dim, case, [t, dim, keepdim])
            _run_meta(aten.all.dims, case, [t, dims, keepdim])
            _run_meta(aten.any.default, case, [t])
        _run_meta(aten.prod.default, case, [i])
        _run_meta(aten.cumprod.default, case, [x, dim], {"dtype": torch.float64})
        for t in (x, i):
            _run_meta(aten.max.dim, case, [t, dim, keepdim])
            _run_meta(aten.min.dim, case, [t, dim, keepdim])
            _run_meta(aten.max.default, case, [t])
            _run_meta(aten.argmax.default, case, [t, rng.choice([dim, None]), keepdim])
            _run_meta(aten.argmin.default, case, [t, dim, keepdim])
            _run_meta(aten.logsumexp.default, case, [t, dims, keepdim])
            size = shape[dim]
            k = rng.randint(1, size)
            _run_meta(aten.topk.default, case, [t, _sym(k) if k == size else k, dim])
        _run_meta(aten.linalg_vector_norm.default, case, [x, rng.choice([2, 1, 3.5]), rng.choice([dims, None]), keepdim])


def test_copies_and_views():
    rng = random.Random(23)
    for _ in range(30):
        case = Case(rng)
        shape = _shape(rng, rng.randint(2, 4))
        ndim = len(shape)
        x = case.tensor(shape, rng.choice([torch.float32, torch.float64, torch.long]))
        _run_meta(aten.tril.default, case, [x, rng.randint(-2, 2)], must_answer=1 not in shape)
        _run_meta(aten.triu.default, case, [x], must_answer=1 not in shape)
        _run_meta(aten.repeat.default, case, [x, [rng.choice([1, 2, 3]) for _ in range(ndim + rng.randint(0, 1))]])
        _run_meta(aten.flip.default, case, [x, _dims(rng, ndim, 2)], must_answer=1 not in shape)
        _run_meta(aten.roll.default, case, [x, [rng.randint(-3, 3)], [rng.randint(-ndim, ndim - 1)]])
        pad = [rng.randint(0, 2) for _ in range(2 * rng.randint(1, ndim))]
        _run_meta(aten.constant_pad_nd.default, case, [x, pad, 0])
        dim = rng.randint(0, ndim - 1)
        size = rng.randint(1, shape[dim])
        _run(aten.unfold.default, case, [x, dim, _sym(size) if size == shape[dim] else size, rng.randint(1, 3)])
        d1, d2 = rng.sample(range(ndim), 2)
        offset = rng.randint(-1, 1)
        if min(shape[d1] + min(offset, 0), shape[d2] - max(offset, 0)) >= 1:
            _run(aten.diagonal.default, case, [x, offset, d1, d2])
        _run(aten.as_strided.default, case, [x, [1, 1], [1, 1]], expected=x.as_strided([1, 1], [1, 1]))
        x4 = case.tensor([rng.randint(1, 3), rng.choice([2, 3]), rng.randint(2, 6), rng.randint(2, 6)])
        out = [rng.randint(1, 9), rng.randint(1, 9)]
        _run_meta(aten.upsample_nearest2d.default, case, [x4, out])
        _run_meta(aten.upsample_bilinear2d.default, case, [x4, out, rng.random() < 0.5])
        _run_meta(aten.constant_pad_nd.default, case, [x4, [1, 1, 2, 0], 0.5])


MORE_UNARY = [aten.exp2.default, aten.log1p.default, aten.expm1.default, aten.log2.default, aten.log10.default,
              aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default, aten.sign.default,
              aten.atan.default, aten.asin.default, aten.acos.default, aten.sinh.default, aten.cosh.default,
              aten.isnan.default, aten.isinf.default, aten.nan_to_num.default, aten.logical_not.default,
              aten.frac.default, aten.erfc.default]
MORE_BINARY = [aten.atan2.default, aten.remainder.Tensor, aten.fmod.Tensor,
               aten.logical_and.default, aten.logical_or.default, aten.hypot.default]
INTEGER_OK = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.maximum.default, aten.remainder.Tensor,
              aten.lt.Tensor, aten.eq.Tensor, aten.logical_and.default]


def test_more_pointwise_ops_and_integer_operands():
    # Ops whose metas torch's Python meta kernels make (and integer or bool operands) answer for contiguous operands
    # of the result's shape; other layouts may refuse but never answer wrongly.
    rng = random.Random(24)
    for _ in range(80):
        case = Case(rng)
        shape = _shape(rng, rng.randint(1, 4))
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        itype = rng.choice([torch.long, torch.int32])
        for kind in ("contiguous", None):
            must = kind is not None and len(shape) != 4  # (4-d may be channels-last as well: refused)
            x, y = case.tensor(shape, dtype, kind), case.tensor(shape, dtype, kind)
            i, j = case.tensor(shape, itype, kind), case.tensor(shape, itype, kind)
            _run_meta(rng.choice(MORE_UNARY), case, [x], must_answer=must)
            _run_meta(rng.choice(MORE_BINARY), case, [x, y], must_answer=must)
            _run_meta(rng.choice([aten.remainder.Scalar, aten.fmod.Scalar]), case, [x, 3], must_answer=must)
            # (Integer arithmetic and comparisons take TensorIterator's layout, as eager does, where torch's meta
            # kernel differs on size-1 dims: compared with eager, without size-1 dims, whose strides are their own
            # story. remainder and logical_and have Python meta kernels, whose layouts kiln keeps.)
            func, scalar_func = rng.choice(INTEGER_OK), rng.choice([aten.add.Tensor, aten.mul.Tensor, aten.remainder.Scalar])
            python_meta = (aten.remainder.Tensor, aten.logical_and.default, aten.remainder.Scalar)
            for f, f_args in ((func, [i, j]), (scalar_func, [i, 2])):
                if f in python_meta:
                    _run_meta(f, case, f_args, must_answer=must)
                elif 1 not in shape:
                    _run(f, case, f_args, must_answer=must)
            _run_meta(aten.eq.Tensor, case, [case.tensor(shape, torch.bool, kind), case.tensor(shape, torch.bool, kind)],
                      must_answer=must)
        y = case.tensor(_broadcast_to(rng, shape), dtype)
        _run_meta(rng.choice(MORE_BINARY), case, [x, y] if rng.random() < 0.5 else [y, x], must_answer=False)
    # Integer operands that promote are refused: a float number, a true division.
    case = Case(rng)
    i = case.tensor([3, 5], torch.long, kind="contiguous")
    space = Space("concrete")
    for func, args in ((aten.add.Tensor, [i, 2.5]), (aten.div.Tensor, [i, i]), (aten.sigmoid.default, [i])):
        full = [_to_kiln(a, case, space) for a in _schema_args(func, args, {})]
        assert not C.shape_rule(f"aten::{func._schema.name[6:]}.{func._overloadname}", full, {})["has_rule"]


def _described(t):
    """{'sizes', 'strides', 'offset', 'dtype', 'device'} of a real tensor, concretely."""
    return {"sizes": list(t.shape), "strides": list(t.stride()), "offset": t.storage_offset(),
            "dtype": DTYPE[t.dtype], "device": CODES["device_types"][t.device.type]}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_convolution_backward_rule_gives_cudnns_layouts_on_cuda(dtype):
    """cuDNN returns a channels-last input's (or weight's) gradients channels-last, whatever the gradient's layout;
    torch 2.11's meta kernel says contiguous, and a graph holding that meta copied every such result back."""
    rng = random.Random(7)
    for _ in range(12):
        n, c, o, h, w = rng.randint(1, 4), rng.choice([3, 8, 16]), rng.choice([8, 16]), rng.randint(5, 14), rng.randint(5, 14)
        k, stride = rng.choice([1, 3]), rng.choice([1, 2])
        x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
        weight = torch.randn(o, c, k, k, device="cuda", dtype=dtype)
        if rng.random() < 0.7:
            x = x.contiguous(memory_format=torch.channels_last)
        if rng.random() < 0.5:
            weight = weight.contiguous(memory_format=torch.channels_last)
        out = torch.nn.functional.conv2d(x, weight, stride=stride, padding=k // 2)
        grad = torch.randn_like(out, memory_format=rng.choice([torch.contiguous_format, torch.channels_last]))
        for mask in ([True, True, False], [True, False, False], [False, True, True]):
            args = [grad, x, weight, [o], [stride, stride], [k // 2, k // 2], [1, 1], False, [0, 0], 1, mask]
            expected = aten.convolution_backward.default(*args)
            got = C.shape_rule("aten::convolution_backward.default",
                               [_described(a) if isinstance(a, torch.Tensor) else a for a in args], {})
            assert got["has_rule"], got["reason"]
            for e, g, wanted in zip(expected, got["outputs"], mask):
                if not wanted:
                    continue
                assert g["sizes_value"] == list(e.shape) and g["strides_value"] == list(e.stride()), \
                    (x.stride(), weight.stride(), grad.stride(), g["text"], e.stride())


def test_group_norm_and_transposed_convolution():
    # Group norm's N, C and HxW are ints its composite computes from the input's sizes; transposed convolutions grow
    # their spatial sizes by the stride.
    rng = random.Random(11)
    for _ in range(12):
        case = Case(rng)
        n, groups, h, w = rng.randint(1, 3), rng.choice([1, 2, 3]), rng.randint(2, 9), rng.randint(2, 9)
        c = groups * rng.choice([1, 2, 3])
        x = case.tensor([n, c, h, w], kind="contiguous")
        weight, bias = case.tensor([c], kind="contiguous"), case.tensor([c], kind="contiguous")
        sizes = [Sym(n, [n]), Sym(c, [c]), Sym(h * w, [h, w])]
        _run(aten.native_group_norm.default, case, [x, weight, bias, *sizes, groups, 1e-5])
        _run(aten.native_group_norm.default, case, [x, None, None, *sizes, groups, 1e-5])
        grad = case.tensor([n, c, h, w], kind="contiguous")
        _, mean, rstd = aten.native_group_norm.default(x, weight, bias, n, c, h * w, groups, 1e-5)
        case.recipes[id(mean)] = case.recipes[id(rstd)] = ("strided", [n, groups], [0, 1], [1, 1], [0, 0], {})
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            _run(aten.native_group_norm_backward.default, case, [grad, x, mean, rstd, weight, *sizes, groups, mask])
        o, k = rng.choice([2, 4]), rng.choice([1, 3, 4])
        for stride, padding, output_padding, dilation, g in (([1, 1], [0, 0], [0, 0], [1, 1], 1),
                                                             ([2, 2], [1, 1], [1, 1], [1, 1], 1),
                                                             ([2, 3], [0, 1], [1, 0], [2, 1], 1),
                                                             ([2, 2], [1, 1], [0, 0], [1, 1], groups)):
            if output_padding[0] >= max(stride[0], dilation[0]) or output_padding[1] >= max(stride[1], dilation[1]):
                continue
            _run(aten.convolution.default, case, [x, case.tensor([c, o, k, k], kind="contiguous"),
                                                  case.tensor([o * g]), stride, padding, dilation, True,
                                                  output_padding, g])


def test_padding_resampling_windows_and_distances():
    rng = random.Random(29)
    for _ in range(12):
        case = Case(rng)
        n, c, h, w = rng.randint(1, 3), rng.choice([2, 4]), rng.randint(3, 9), rng.randint(3, 9)
        x3, x4, x5 = case.tensor([n, c, w]), case.tensor([n, c, h, w]), case.tensor([n, c, 3, h, w])
        for k, x in ((1, x3), (2, x4), (3, x5)):
            for func in (getattr(aten, f"reflection_pad{k}d"), getattr(aten, f"replication_pad{k}d")):
                _run_meta(func.default, case, [x, [rng.randint(0, 2) for _ in range(2 * k)]])
        out = [rng.randint(1, 9) for _ in range(3)]
        _run_meta(aten.upsample_nearest1d.default, case, [x3, out[:1]])
        _run_meta(aten.upsample_linear1d.default, case, [x3, out[:1], rng.random() < 0.5])
        _run_meta(aten.upsample_bicubic2d.default, case, [x4, out[:2], rng.random() < 0.5])
        _run_meta(aten._upsample_nearest_exact2d.default, case, [x4, out[:2]])
        _run_meta(aten.upsample_trilinear3d.default, case, [x5, out, rng.random() < 0.5])
        _run_meta(aten.pixel_shuffle.default, case, [case.tensor([n, 4 * c, h, w]), 2], must_answer=False)
        _run_meta(aten.pixel_unshuffle.default, case, [case.tensor([n, c, 2 * h, 2 * w]), 2], must_answer=False)
        kernel, dilation, padding, stride = [2, 3], [1, rng.choice([1, 2])], [rng.randint(0, 1), 1], [1, rng.choice([1, 2])]
        _run_meta(aten.im2col.default, case, [x4, kernel, dilation, padding, stride])
        blocks = aten.im2col.default(torch.empty(n, c, h, w, device="meta"), kernel, dilation, padding, stride).shape[-1]
        columns = case.tensor([n, c * 6, blocks])
        _run_meta(aten.col2im.default, case, [columns, [h, w], kernel, dilation, padding, stride])
        _run_meta(aten.adaptive_max_pool2d.default, case, [x4, out[:2]])
        _run_meta(aten._adaptive_avg_pool3d.default, case, [x5, out], must_answer=False)
        rows = [rng.randint(2, 9), rng.randint(2, 9)]
        a, b = case.tensor([n, rows[0], c]), case.tensor([n, rows[1], c])
        _run_meta(aten._cdist_forward.default, case, [a, b, rng.choice([1.0, 2.0]), None])
        _run(aten.linspace.default, case, [0, rng.choice([1, 2.5]), _sym(h)], rng.choice([{}, {"dtype": torch.float64}]))
        xc = case.tensor([n, 4 * c, h, w], kind="contiguous")  # (contiguous inputs: every mode answers)
        assert _run_meta(aten.reflection_pad2d.default, case, [xc, [1, 1, 2, 0]]) > 0
        assert _run_meta(aten.pixel_shuffle.default, case, [xc, 2]) > 0
        assert _run_meta(aten.im2col.default, case, [xc, kernel, dilation, padding, stride]) > 0
        assert _run_meta(aten.upsample_linear1d.default, case, [case.tensor([n, c, w], kind="contiguous"), [7], False]) > 0


def test_sort_bucketize_and_mixed_dtype_arithmetic():
    rng = random.Random(31)
    for _ in range(12):
        case = Case(rng)
        shape = [rng.choice([2, 3, 5, 7]) for _ in range(rng.randint(1, 4))]
        x = case.tensor(shape, rng.choice([torch.float32, torch.long]))
        _run_meta(aten.sort.default, case, [x, rng.randint(-len(shape), len(shape) - 1), rng.random() < 0.5])
        _run_meta(aten.sort.stable, case, [x], {"stable": True, "dim": -1})
        _run_meta(aten.bucketize.Tensor, case, [x, case.tensor([5], x.dtype, "contiguous")], {"out_int32": rng.random() < 0.5})
        f = case.tensor(shape, torch.float32)
        _run_meta(aten.pow.Scalar, case, [rng.choice([2, 10000.0]), f])
        # A floating operand beside an integer one: the floating dtype, contiguous where every operand is.
        positions = case.tensor(shape[-1:], torch.long, "contiguous")
        for func in (aten.div.Tensor, aten.mul.Tensor, aten.lt.Tensor):
            _run_meta(func, case, [case.tensor(shape, kind="contiguous"), positions])
            _run_meta(func, case, [positions, f], must_answer=False)
