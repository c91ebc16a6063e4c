"""Training through kiln: graphs that need grad compile to a forward and a backward graph joined by one
autograd node (csrc/autodiff, csrc/compile/split_for_autodiff.*, csrc/runtime/autograd_graph.*). Gradients are
compared with eager's on fresh random inputs; kiln._C.compiler_stats() proves the compiled autograd path ran (no eager
fallback)."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
import kiln.errors
from kiln.testing import assert_same_as_eager, random_class_targets, random_tensor, tolerance

seed_models = pytest.importorskip("seed_models")  # benchmarks/seed_models.py (conftest puts benchmarks/ on the path)


@pytest.fixture(autouse=True)
def fresh_kiln(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    kiln.reset()
    kiln._C.reset_compiler_stats()
    kiln.config.set_compiled_autograd(True)  # the default (see kiln.config); these tests are about it
    yield
    kiln.config.set_compiled_autograd(False)
    kiln.reset()


def assert_compiled_autograd(expect_graphs=1):
    stats = kiln._C.compiler_stats()
    assert stats["graphs_fallback"] == 0, stats["last_fallback_reason"]
    assert stats["graphs_compiled"] >= 2 * expect_graphs, stats  # a forward and a backward per graph


def r(*shape, grad=True):
    return random_tensor(*shape, requires_grad=grad)


# (name, fn, input shapes); every input requires grad unless its shape is wrapped in ("nograd", shape).
RULE_CASES = [
    ("linear_relu", lambda x, w, b: F.relu(F.linear(x, w, b)), [(5, 8), (4, 8), (4,)]),
    ("mm", lambda a, b: a @ b, [(5, 8), (8, 3)]),
    ("bmm", lambda a, b: torch.bmm(a, b), [(2, 5, 8), (2, 8, 3)]),
    ("add_broadcast", lambda a, b: a + b, [(4, 5), (5,)]),
    ("add_broadcast_keepdim", lambda a, b: a + 2 * b, [(4, 5), (4, 1)]),
    ("sub_broadcast", lambda a, b: a - b, [(3, 4, 5), (1, 5)]),
    ("mul_broadcast", lambda a, b: a * b, [(4, 5), (5,)]),
    ("div_broadcast", lambda a, b: a / (b * b + 1), [(4, 5), (4, 1)]),
    ("scalars", lambda a: (a * 3 - 1) / 2 + 4, [(4, 5)]),
    ("neg_exp_tanh_sigmoid", lambda a: torch.exp(-a) + torch.tanh(a) * torch.sigmoid(a), [(4, 5)]),
    ("gelu", lambda a: F.gelu(a), [(4, 5)]),
    ("gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), [(4, 5)]),
    ("views", lambda a: a.view(2, 10).t().reshape(5, 4).unsqueeze(0).squeeze(0).permute(1, 0) * 2, [(4, 5)]),
    ("transpose_contiguous", lambda a: a.transpose(0, 1).contiguous() * 2, [(4, 5)]),
    ("expand", lambda a, b: a.expand(3, 4, 5) * b, [(4, 1), (3, 4, 5)]),
    ("sum_mean", lambda a: a.sum() + a.mean(dim=1).sum() + a.sum(dim=0, keepdim=True).mean(), [(4, 5)]),
    ("softmax", lambda a: torch.softmax(a, dim=-1) * a, [(4, 5)]),
    ("log_softmax", lambda a: torch.log_softmax(a, dim=1), [(4, 5)]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), [(3, 5, 8), (8,), (8,)]),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), [(2, 3, 8, 8), (4, 3, 3, 3), (4,)]),
    ("select_slice", lambda a: a[1] * 2 + a[:, 1:3].sum(), [(4, 5)]),
    ("chunk_all_used", lambda a: sum(c * (i + 1) for i, c in enumerate(a.chunk(3, dim=1))), [(4, 6)]),
    ("chunk_one_unused", lambda a: a.chunk(3, dim=-1)[0] * 2 + a.chunk(3, dim=-1)[2], [(4, 6)]),
    ("split_sizes", lambda a: torch.split(a, [1, 3], dim=0)[1].exp(), [(4, 5)]),
    ("unbind", lambda a: a.unbind(1)[0] * a.unbind(1)[2], [(4, 3)]),
    ("cat", lambda a, b: torch.cat([a, b * 2, a], dim=1).tanh(), [(4, 3), (4, 2)]),
    ("cat_negative_dim", lambda a, b: torch.cat([a.exp(), b], dim=-2) * 3, [(2, 3, 5), (2, 1, 5)]),
    ("pow", lambda a: a.pow(2) + a.pow(3), [(4, 5)]),
    ("silu", lambda a: F.silu(a), [(4, 5)]),
    ("max_pool2d", lambda a: F.max_pool2d(a, 3, 2, 1), [(2, 3, 9, 9)]),
    ("max_pool2d_after_relu", lambda a: F.max_pool2d(torch.relu(a), 2), [(2, 3, 8, 8)]),
    ("avg_pool2d", lambda a: F.avg_pool2d(a, 3, 2, 1), [(2, 3, 9, 9)]),
    ("adaptive_avg_pool2d", lambda a: F.adaptive_avg_pool2d(a, (3, 2)), [(2, 3, 7, 6)]),
    ("adaptive_avg_pool2d_1x1_flatten", lambda a: torch.flatten(F.adaptive_avg_pool2d(a, 1), 1) * 2, [(2, 3, 5, 5)]),
    # session 7's rules: math, masks, shapes, losses, norms, statistics, interpolation
    ("sqrt_log_rsqrt", lambda x: torch.sqrt(x.abs() + 1) * torch.log(x.abs() + 2) + torch.rsqrt(x * x + 1), [(4, 6)]),
    ("sin_cos_erf_expm1", lambda x: torch.sin(x) * torch.cos(x) + torch.erf(x) + torch.expm1(x * 0.1), [(4, 6)]),
    ("where_clamp", lambda x, y: torch.where(x > 0, x, y).clamp(-0.5, 0.7) + x.clamp_min(0.1) + y.clamp_max(0.2), [(4, 6), (4, 6)]),
    ("maximum_minimum", lambda x, y: torch.maximum(x, y) * 2 + torch.minimum(x, y.round()), [(4, 6), (4, 6)]),
    ("flip_roll_pad_cumsum", lambda x: F.pad(x.flip(1).roll(2, 0), (1, 2)).cumsum(1), [(4, 6)]),
    ("stack_gather", lambda x, y: torch.stack([x, y], 1).gather(2, torch.tensor([[[0, 2], [1, 1]]]).expand(4, 2, 2)), [(4, 6), (4, 6)]),
    ("cross_entropy", lambda x: F.cross_entropy(x, torch.tensor([1, 0, 3, 2])), [(4, 6)]),
    ("mse_smooth_l1_huber", lambda x, y: F.mse_loss(x, y) + F.smooth_l1_loss(x, y) + F.huber_loss(x, y, delta=0.5), [(4, 6), (4, 6)]),
    ("bce_with_logits", lambda x: F.binary_cross_entropy_with_logits(x, (torch.arange(24.0).view(4, 6) % 3 == 0).float()), [(4, 6)]),
    ("normalize_var_std", lambda x: F.normalize(x, dim=1) + x.var(1, keepdim=True) + x.std(0), [(4, 6)]),
    ("amax_amin", lambda x: x.amax(1) + x.amin(1), [(4, 6)]),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear").sum(1) + F.interpolate(x, size=(6, 4), mode="nearest").mean(1), [(2, 3, 3, 2)]),
    ("group_norm_log_sigmoid", lambda x, w, b: F.logsigmoid(F.group_norm(x, 2, w, b)), [(2, 4, 3), (4,), (4,)]),
]

# Session 15's rules (autodiff/derivative_rules_math.cpp), with the inputs where their formulas have edges: zeros in a
# product (one per row, and two in one row), ties for the maximum, a zero base under a tensor power, clamp bounds that
# cross (min > max), norms of rows that are all zero, NaN skipped by nansum, sinc at 0.
_ZEROS = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                       [0.0, 1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
_ZERO_ROW = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
_NAN_AT = _ZEROS == 0
_COLUMNS = torch.tensor([[0, 2], [1, 3], [5, 4], [2, 0]])
_ROWS = torch.tensor([0, 2])
RULE_CASES += [
    ("trig_hyperbolic", lambda x: torch.tan(x * 0.5) + torch.sinh(x) + torch.cosh(x) + torch.asin(x.tanh() * 0.9)
     + torch.acos(x.sigmoid() * 0.9) + torch.atan(x) + torch.asinh(x) + torch.acosh(x.abs() + 1.5)
     + torch.atanh(x.tanh() * 0.9), [(4, 6)]),
    ("logs_exps_special", lambda x: torch.log2(x.abs() + 1) + torch.log10(x.abs() + 1) + torch.exp2(x) + torch.erfc(x)
     + torch.erfinv(x.tanh() * 0.9) + torch.lgamma(x.abs() + 0.5) + torch.digamma(x.abs() + 0.5)
     + torch.special.ndtri(x.sigmoid()) + torch.special.log_ndtr(x) + torch.special.erfcx(x)
     + torch.special.entr(x.abs() + 0.1) + torch.sinc(x * _ZEROS) + torch.special.i0e(x) + torch.special.i1(x * _ZEROS)
     + torch.special.i1e(x) + torch.i0(x) + torch.logit(x.sigmoid()) + torch.rad2deg(x) + torch.deg2rad(x)
     + torch.frac(x * 3) + torch.nan_to_num(x) + torch.polygamma(2, x.abs() + 1) + torch.mvlgamma(x.abs() + 2, 3), [(4, 6)]),
    ("binary_math", lambda x, y: torch.atan2(x, y) + torch.hypot(x, y) + torch.fmax(x, y) + torch.fmin(x, y)
     + torch.copysign(x * _ZEROS, y) + torch.logaddexp(x, y) + torch.logaddexp2(x, y)
     + torch.xlogy(x.abs() * _ZEROS, y.abs() + 0.5) + torch.special.xlog1py(x.abs(), y.abs()), [(4, 6), (4, 6)]),
    ("pow_with_a_zero_base", lambda x, y: (x * _ZEROS).pow(y.abs() + 1) + (x.abs() + 0.5).pow(y), [(4, 6), (4, 6)]),
    ("lerp_addcmul_addcdiv_rsub", lambda x, y, w: torch.lerp(x, y, w.sigmoid()) + torch.lerp(x, y, 0.3)
     + torch.addcmul(x, y, w, value=0.5) + torch.addcdiv(x, y, w.abs() + 1, value=2) + torch.rsub(x, y, alpha=2),
     [(4, 6), (4, 6), (4, 6)]),
    ("remainder_fmod_rounded_div", lambda x, y: torch.remainder(x, y.abs() + 1) + torch.fmod(x, y.abs() + 1)
     + torch.div(x, y.abs() + 1, rounding_mode="floor") + torch.div(x, y.abs() + 1, rounding_mode="trunc"),
     [(4, 6), (4, 6)]),
    ("clamp_tensor_bounds", lambda x, lo, hi: torch.clamp(x, lo, hi) + torch.clamp(x, min=lo) + torch.clamp(x, max=hi)
     + torch.clamp_min(x, lo) * 2 + torch.clamp_max(x, hi) * 3, [(4, 6), (4, 6), (4, 6)]),
    ("selecting_reductions", lambda x: torch.cat([x, x], 1).max() + torch.cat([x, x], 1).min() + torch.median(x)
     + x.max(1).values.sum() + x.min(0).values.sum() + x.median(1).values.sum() + x.sort(1).values[:, 0].sum()
     + x.topk(2, 1).values.sum() + x.kthvalue(2, 1).values.sum() + x.cummax(1).values.sum()
     + x.cummin(0).values.sum(), [(4, 6)]),
    ("aminmax", lambda x: x.aminmax(dim=1).max.sum() + 2 * torch.cat([x, x], 1).aminmax().min, [(4, 6)]),
    ("prod_with_zeros", lambda x: (x * _ZEROS).prod() + (x * _ZEROS).prod(1).sum() + x.prod(0).sum()
     + (x * _ZEROS).prod(1, keepdim=True).sum(), [(4, 6)]),
    ("norms", lambda x, y: torch.linalg.vector_norm(x, 1, dim=1) + torch.linalg.vector_norm(x, float("inf"), dim=1)
     + torch.linalg.vector_norm(x, 3, dim=1) + torch.linalg.vector_norm(x * _ZERO_ROW, 1.5, dim=1)
     + torch.linalg.vector_norm(x, 0.5, dim=1) + torch.linalg.vector_norm(x * _ZERO_ROW, dim=1)
     + torch.norm(x, p=2, dim=1) + torch.dist(x, y) + F.pairwise_distance(x, y), [(4, 6), (4, 6)]),
    ("statistics", lambda x: sum(t.sum() for t in torch.var_mean(x, 1)) + torch.std_mean(x, 0)[0].sum()
     + 2 * torch.std_mean(x, 0, keepdim=True)[1].sum() + x.masked_fill(_NAN_AT, float("nan")).nansum(1).sum()
     + torch.var_mean(x, correction=0)[1], [(4, 6)]),
    ("matrix_vector_products", lambda a, v, w, b1, b2: torch.trace(a) + torch.vdot(v, w) + torch.addr(a, v, w).sum()
     + torch.addmv(v, a, w, beta=0.5, alpha=2).sum() + torch.addbmm(a, b1, b2, alpha=0.5).sum(),
     [(4, 4), (4,), (4,), (2, 4, 3), (2, 3, 4)]),
    ("scatter_and_index_updates", lambda x, s, s2: x.scatter(1, _COLUMNS, s).sum(1) + x.scatter_add(1, _COLUMNS, s).sum(1)
     + x.index_add(0, _ROWS, s2, alpha=2).sum(1) + x.index_copy(0, _ROWS, s2).sum(1) + x.index_fill(1, _ROWS, 2.0).sum(1)
     + x.masked_scatter(_NAN_AT, s2).sum(1) + x.take(_COLUMNS).sum(1) + x.put(_COLUMNS, s, accumulate=True).sum(1)
     + x.index_put((_ROWS, _ROWS), s2[0, :2]).sum(1) + x.scatter(1, _COLUMNS, 0.5).sum(1), [(4, 6), (4, 2), (2, 6)]),
    ("shape_ops", lambda x, y, z: x.repeat(2, 1, 3).sum(0)[:, :6] + torch.rot90(y, 1, (0, 1))
     + torch.diag_embed(x)[:, :, 0] + torch.diagonal(y.reshape(4, 6, 1).expand(4, 6, 6), 0, 1, 2)
     + torch.slice_scatter(x, y.t()[:, 1:3], 1, 1, 3) + torch.select_scatter(x, y.t()[0], 0, 2)
     + torch.diagonal_scatter(x, y.diagonal(), 0) + F.pixel_shuffle(z, 2).reshape(4, 6)
     + F.pixel_unshuffle(z.reshape(1, 1, 4, 6), 2).reshape(4, 6) + F.channel_shuffle(z, 2).reshape(4, 6),
     [(4, 6), (6, 4), (1, 4, 2, 3)]),
    ("losses_pooling_padding_sampling", lambda x, v, g, w: F.binary_cross_entropy(x.sigmoid(), (x > 0.3).float()).expand(2)
     + F.soft_margin_loss(x, torch.sign(x.detach() - 0.1)).expand(2) + F.max_pool3d(v, 2).sum((1, 2, 3, 4))
     + F.avg_pool3d(v, 2).sum((1, 2, 3, 4)) + F.adaptive_max_pool2d(x, 2).sum((1, 2, 3))
     + F.adaptive_avg_pool3d(v, 3).sum((1, 2, 3, 4)) + F.pad(x.flatten(2), (1, 2), mode="reflect").sum((1, 2))
     + F.pad(x.flatten(2), (2, 1), mode="replicate").sum((1, 2)) + F.pad(x, (1, 1, 2, 0), mode="replicate").sum((1, 2, 3))
     + F.pad(x, (1, 2, 0, 1), mode="reflect").sin().sum((1, 2, 3)) + F.pad(v, (1, 0, 1, 1, 0, 2), mode="reflect").cos().sum((1, 2, 3, 4))
     + F.pad(v, (0, 1, 2, 1, 1, 0), mode="replicate").sin().sum((1, 2, 3, 4))
     + F.unfold(x, 2).sum((1, 2)) + F.grid_sample(x, g.tanh(), align_corners=False).sum((1, 2, 3))
     + F.fold(F.unfold(x, 2).cos(), (4, 4), 2).sum((1, 2, 3))
     + F.prelu(x, w).sum((1, 2, 3)) + torch.cdist(x.flatten(2), x.flatten(2)[:, :2]).sum((1, 2))
     + F.pdist(x.flatten(1)).expand(2) * 0 + F.interpolate(x.flatten(2), scale_factor=2, mode="nearest-exact").sum((1, 2)),
     [(2, 3, 4, 4), (2, 3, 4, 4, 4), (2, 3, 3, 2), (3,)]),
    ("scatter_reduce_logcumsumexp", lambda x, s: x.scatter_reduce(1, _COLUMNS, s, "sum").sum(1)
     + x.scatter_reduce(1, _COLUMNS, s, "mean", include_self=False).sum(1)
     + x.scatter_reduce(1, _COLUMNS, s, "amax").sum(1) + x.scatter_reduce(1, _COLUMNS, s, "amin", include_self=False).sum(1)
     + torch.logcumsumexp(x, 1).sin().sum(1), [(4, 6), (4, 2)]),
    ("cumprod_with_zeros", lambda x: torch.cumprod(x * _ZEROS, 1).sum(1) + torch.cumprod(x * _ZEROS, 0).sum(0)[:4]
     + torch.cumprod(x, 1).sin().sum(1), [(4, 6)]),
    ("bilinear_and_max_unpool", lambda a, b, w, bias, v: F.bilinear(a, b, w, bias).sum(1)[:2]
     + F.max_unpool2d(*F.max_pool2d(v, 2, return_indices=True), 2).sin().sum((1, 2, 3))
     + F.max_unpool1d(*F.max_pool1d(v.flatten(2), 2, return_indices=True), 2).cos().sum((1, 2)),
     [(3, 4), (3, 5), (6, 4, 5), (6,), (2, 3, 4, 6)]),
    ("linear_algebra", lambda a, b, m: torch.linalg.inv(a + 4 * torch.eye(4)).sum(0)
     + torch.linalg.solve(a + 4 * torch.eye(4), b).sum(1) + torch.linalg.solve(a + 4 * torch.eye(4), b.t(), left=False).sum(0)
     + torch.linalg.solve_triangular(a.triu() + 4 * torch.eye(4), b, upper=True).sum(1)
     + torch.linalg.solve_triangular(a.tril(), b, upper=False, unitriangular=True).sum(1)
     + torch.linalg.cholesky(m @ m.t() + 4 * torch.eye(4)).sum(0) + torch.linalg.cholesky(m @ m.t() + torch.eye(4), upper=True).sum(1)
     + torch.linalg.slogdet(a + 4 * torch.eye(4)).logabsdet + torch.linalg.solve(a + 4 * torch.eye(4), b[0]).sum()
     + torch.cholesky_solve(b, torch.linalg.cholesky(m @ m.t() + 4 * torch.eye(4))).sum(0)
     + torch.linalg.lu_solve(*torch.linalg.lu_factor(a.detach() + 4 * torch.eye(4)), b).sum(1),
     [(4, 4), (4, 4), (4, 4)]),
    ("activations_and_copies", lambda x: F.celu(x, 0.7) + F.softshrink(x, 0.3) + F.hardshrink(x, 0.3)
     + F.threshold(x, 0.2, -1.0) + torch.ops.aten.view_copy(x, (6, 4)).t()
     + torch.ops.aten.unfold_copy(x, 1, 3, 3).flatten(1) + torch.ops.aten.diagonal_copy(x.expand(6, 4, 6), 0, 0, 2), [(4, 6)]),
    ("narrow_copy", lambda x: torch.ops.aten.narrow_copy(x, 1, 1, 4).repeat(1, 2)[:, :6] * x, [(4, 6)]),
    # ATen's 1x1 adaptive average pool of a channels-last input restrides its mean with as_strided_ (timm's ConvNeXt
    # head: the graph trained on the eager interpreter); ConViT's `1. - sigmoid(p)` is rsub.Scalar.
    # timm's MetaFormer: a group norm whose gradient arrives permuted (a LayerNorm2d after it). ATen's group norm
    # backward reads the gradient in the input's layout: x's gradient was 78% off, silently.
    ("group_norm_then_permuted_layer_norm", lambda x, wg, wl, wc: F.conv2d(F.layer_norm(
        (x + F.group_norm(x, 1, wg, None, 1e-6)).permute(0, 2, 3, 1), (4,), wl, None, 1e-6).permute(0, 3, 1, 2), wc,
        None, 2, 1), [(2, 4, 4, 4), (4,), (4,), (3, 4, 3, 3)]),
    ("group_norm_of_channels_last_with_a_permuted_gradient", lambda x, wg, b: F.group_norm(
        (x * 2).contiguous(memory_format=torch.channels_last), 2, wg, b).permute(0, 2, 3, 1).sin(),
     [(2, 4, 3, 5), (4,), (4,)]),
    ("channels_last_global_pool_and_rsub", lambda x: F.adaptive_avg_pool2d(
        (x * 2).contiguous(memory_format=torch.channels_last), 1).permute(0, 2, 3, 1).sin().flatten(1)
     + torch.rsub(x.sigmoid(), 1.0, alpha=2).sum((2, 3)) + (1.0 - x).sum((2, 3)), [(2, 3, 4, 5)]),
]


@pytest.mark.parametrize("name,fn,shapes", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rule_gradients_match_eager(name, fn, shapes):
    inputs = [r(*s) for s in shapes]
    try:  # older torch lacks some derivatives (2.11: aminmax, narrow_copy): nothing to compare with
        fn(*[t.detach().clone().requires_grad_() for t in inputs]).sum().backward()
    except RuntimeError as e:
        if "is not implemented" not in str(e):
            raise
        pytest.skip(f"eager torch {torch.__version__} cannot differentiate it: {e}")
    assert_same_as_eager(fn, *inputs)
    assert_compiled_autograd()


def test_outputs_that_are_inputs_are_the_callers_tensors():
    """`return x, ..., w`: the compiled graph computes the rest on compiled autograd and hands back the caller's own
    tensors, as eager does (the same objects, gradients flowing to them directly)."""
    def f(x, w):
        return x, (x * w).tanh().sum(), w

    x, w = r(4, 5), r(4, 5)
    compiled = kiln.compile(f)
    assert_same_as_eager(f, x, w, compiled=compiled)
    assert_compiled_autograd()
    a, loss, b = compiled(x, w)
    assert a is x and b is w
    (a.sum() * 2 + loss + b.pow(2).sum()).backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    a_ref, loss_ref, b_ref = f(x_ref, w_ref)
    (a_ref.sum() * 2 + loss_ref + b_ref.pow(2).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        a, _, b = compiled(x, w)
    assert a is x and b is w


def test_outputs_that_view_inputs_are_eager_views():
    """`return x.t(), ..., w[1:]`: the views are made again on the caller's tensors, so they share storage and version
    counter with them and carry eager's view backward; the rest runs on compiled autograd."""
    def f(x, w):
        return x.t(), (x * w).sigmoid().sum(), w[1:].unsqueeze(0)

    x, w = r(4, 5), r(4, 5)
    compiled = kiln.compile(f)
    assert_same_as_eager(f, x, w, compiled=compiled)
    assert_compiled_autograd()
    xt, loss, w_view = compiled(x, w)
    assert xt.data_ptr() == x.data_ptr() and xt._base is x and xt.grad_fn is not None
    assert w_view._base is w and w_view.shape == (1, 3, 5)
    with torch.no_grad():
        xt, _, _ = compiled(x, w)
    assert xt._base is x and xt.grad_fn is None


def test_pieces_of_an_input_returned_are_eager_views():
    """chunk / unbind pieces of an input, returned as they are, come back as eager's views (SplitBackward and all)."""
    def f(x, w):
        a, b = x.chunk(2, 1)
        return a, x.unbind(0)[1], (x * w).sum(), b.t()

    x, w = r(3, 4), r(3, 4)
    compiled = kiln.compile(f)
    assert_same_as_eager(f, x, w, compiled=compiled)
    assert_compiled_autograd()
    a, row, _, bt = compiled(x, w)
    assert a._base is x and row._base is x and bt._base is x
    assert type(a.grad_fn).__name__ == type(f(x, w)[0].grad_fn).__name__


def test_mixed_requires_grad_inputs():
    x, w = r(5, 8, grad=False), r(4, 8)
    assert_same_as_eager(lambda x, w: torch.relu(x @ w.t()), x, w)
    assert_compiled_autograd()


def test_embedding():
    weight = r(10, 6)
    indices = torch.randint(0, 10, (3, 4))
    assert_same_as_eager(lambda w, i: F.embedding(i, w) * 2, weight, indices)
    assert_compiled_autograd()


def test_mlp_module_parameters_accumulate():
    model = seed_models.MLP()
    assert_same_as_eager(model, random_tensor(8, 100))
    assert_compiled_autograd()


def test_grad_accumulates_over_two_backwards_and_retain_graph():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    x = random_tensor(4, 6)
    compiled = kiln.compile(model)
    out = compiled(x)
    loss = out.pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # second backward through the same saved values
    ref_loss = reference(x).pow(2).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert_compiled_autograd()


def packed_bytes(t):
    return (t.numel() * t.element_size() + 511) // 512 * 512


@pytest.mark.parametrize("set_to_none", [True, False])
def test_leaf_gradients_are_packed_side_by_side_and_train_as_eager(set_to_none):
    # The backward writes the gradients AccumulateGrad keeps into shared buckets (kernel_graph.cpp, run_packing):
    # the Linear layers' weights (mm through its out= overload, behind t() views) and biases (generated sums).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x = random_tensor(8, 12)
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        compiled(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
            assert not p.grad._is_view() and p.grad.stride() == q.grad.stride(), name
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    if set_to_none:  # the last step's gradients are the backward's own outputs: one bucket, nothing else in it
        grads = [p.grad for p in model.parameters()]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        assert len(storages) == 1, storages
        assert grads[0].untyped_storage().nbytes() == sum(packed_bytes(g) for g in grads)
    assert_compiled_autograd()


class TransposedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 12).t())  # a leaf laid out (1, 12)
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b)


def test_a_transposed_parameter_gets_its_gradient_in_its_layout_when_packed():
    torch.manual_seed(0)
    model = TransposedWeight()
    reference = copy.deepcopy(model)
    x = random_tensor(5, 12)
    kiln.compile(model)(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        assert p.grad.stride() == q.grad.stride(), (name, p.grad.stride(), q.grad.stride())
    assert_compiled_autograd()


class FlippedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.w = nn.Parameter(torch.randn(8, 6))

    def forward(self, idx):
        return self.embedding(idx) @ self.w


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradients_made_by_extern_ops_alone_are_packed_on_the_parameters_device(device):
    # The backward makes both leaf gradients with extern ops: w's with mm's out= overload (into its bucket), the
    # embedding's with embedding_dense_backward on its own (its out= overload would only copy the result in): a graph
    # without one generated kernel, whose buckets must still be on the leaves' device.
    torch.manual_seed(0)
    model = FlippedEmbedding().to(device)
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    for _ in range(2):
        idx = torch.randint(0, 10, (4, 5), device=device)
        for p in list(model.parameters()) + list(reference.parameters()):
            p.grad = None
        compiled(idx).pow(2).sum().backward()
        reference(idx).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad.device == q.grad.device, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert_compiled_autograd()


def test_gradients_of_non_leaves_are_not_packed_with_the_leaves():
    # x's gradient flows on to eager's node for `leaf * 2` and is freed there; in a bucket with the weights'
    # gradients it would keep the bucket's other bytes alive, so only leaves are packed.
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    leaf = random_tensor(4, 6, requires_grad=True)
    compiled = kiln.compile(model)
    compiled(leaf * 2).sum().backward()
    ref_leaf = leaf.detach().clone().requires_grad_()
    reference(ref_leaf * 2).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    weight_storage = model[0].weight.grad.untyped_storage().data_ptr()
    assert model[2].weight.grad.untyped_storage().data_ptr() == weight_storage
    assert leaf.grad.untyped_storage().data_ptr() != weight_storage
    assert_compiled_autograd()


@pytest.mark.parametrize("method", ["register_hook", "retain_grad"])
def test_autograd_hooks_registered_in_compiled_code_act_as_in_eager(method):
    """Regression: a hook registered on a tensor inside compiled code was registered on a trace-time fake and
    dropped (x.grad was half of eager's). Such a call is a graph break and runs on the real tensor."""
    seen = []

    def f(x, w):
        h = x @ w
        if method == "register_hook":
            h.register_hook(lambda g: g * 2)
        else:
            h.retain_grad()
            seen.append(h)
        return torch.tanh(h)

    x, w = r(4, 5), r(5, 3)
    out_eager = f(x, w)
    out_eager.sum().backward()
    grads_eager = x.grad.clone(), w.grad.clone()
    eager_h_grad = seen.pop().grad if seen else None
    x.grad = w.grad = None
    compiled = kiln.compile(f)
    for _ in range(2):  # the second call is a cache hit
        compiled(x, w).sum().backward()
        torch.testing.assert_close((x.grad, w.grad), grads_eager)
        if method == "retain_grad":
            torch.testing.assert_close(seen.pop().grad, eager_h_grad)
        x.grad = w.grad = None
    explained = kiln.explain(f)(x, w)
    assert method in explained.break_reasons[0], explained.break_reasons


class TwoLinearHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x).tanh(), self.b(x).sin()


def test_hooks_of_parameters_no_gradient_reaches_are_not_called():
    """A parameter whose head got no gradient in a step: eager's engine never reaches it, so its tensor hooks are
    not called. The compiled graph's one autograd node has an edge to it all the same, which the engine takes with an
    undefined gradient: the hook was called with None (`lambda g: g * 2` raised a TypeError). The hooks are set aside
    for that backward pass; a later pass that reaches the parameter calls them, and a reached one gets its gradient
    through its hook as in eager."""
    torch.manual_seed(0)
    model = TwoLinearHeads()
    reference = copy.deepcopy(model)
    calls = {"kiln": [], "eager": []}
    for name, m in (("kiln", model), ("eager", reference)):
        for head in ("a", "b"):
            getattr(m, head).weight.register_hook(lambda g, head=head, log=calls[name]: log.append(head) or g * 2)
    compiled = kiln.compile(model)
    x = random_tensor(3, 4)
    for output in (0, 1, 0):  # one head per step, the other's parameters unreached
        compiled(x)[output].sum().backward()
        reference(x)[output].sum().backward()
        assert calls["kiln"] == calls["eager"], calls
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert calls["eager"] == ["a", "b", "a"]
    assert_compiled_autograd()


class HeadsOverInputs(nn.Module):
    """Two heads over tensors computed outside the compiled function: `h` feeds one head, `other` the other."""

    def __init__(self):
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, h, other):
        return self.a(h).tanh(), self.b(other).sin()


def doubling_hook(log, name):
    return lambda g: log.append((name, None if g is None else tuple(g.shape))) or g * 2


# How the step treats h = w0 * x, computed eagerly before the compiled call: what eager does when the head over h gets
# no gradient (step 1 of three) is what kiln must do.
NON_LEAF_INPUT_CASES = {
    "hook": lambda h, w0, log: h.register_hook(doubling_hook(log, "h")),  # eager never calls it
    "retain_grad": lambda h, w0, log: h.retain_grad(),  # eager leaves h.grad None
    "hook_upstream": lambda h, w0, log: w0.register_hook(doubling_hook(log, "w0")),  # a leaf behind h: not reached
}


@pytest.mark.parametrize("case", list(NON_LEAF_INPUT_CASES))
@pytest.mark.parametrize("eager_path", [False, True], ids=["only_compiled", "also_eager"])
def test_hooks_of_non_leaf_inputs_no_gradient_reaches_are_not_called(case, eager_path):
    """A non-leaf input (computed eagerly, with requires_grad) that feeds only an output the loss ignores: eager's
    engine never reaches its grad_fn, so its hooks (and those of what it was computed from) are not called. The
    compiled graph's autograd node has an edge to it all the same, and the engine called h's hook with None (`g * 2`
    raised). With `also_eager` the loss also reads h outside the compiled function: its grad_fn is reached through that
    path, and its hook gets that gradient, as in eager."""
    torch.manual_seed(0)
    model = HeadsOverInputs()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    x, other = random_tensor(3, 4), random_tensor(3, 4)
    for output in (0, 1, 0):
        results = {}
        for name, fn, m in (("kiln", compiled, model), ("eager", reference, reference)):
            log = []
            h = m.w0 * x
            NON_LEAF_INPUT_CASES[case](h, m.w0, log)
            loss = fn(h, other)[output].sum()
            if eager_path:
                loss = loss + (h * 3).sum()
            loss.backward()
            results[name] = log, h.grad if case == "retain_grad" else None
        assert results["kiln"][0] == results["eager"][0], results
        torch.testing.assert_close(results["kiln"][1], results["eager"][1])
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert_compiled_autograd()


def test_graph_whose_outputs_get_no_gradient_runs_no_backward():
    """h, made by one compiled function, feeds only the unused head of another: the first graph's autograd node is
    reached only by an edge that carries no gradient. Eager runs none of its backward and calls no hook of h or of the
    parameter it read; kiln ran that backward on zeros (which a hook on h, such as FSDP2's unshard, would precede)."""
    torch.manual_seed(0)
    model = HeadsOverInputs()
    reference = copy.deepcopy(model)
    log = []
    for name, m in (("kiln", model), ("eager", reference)):
        m.w0.register_hook(doubling_hook(log, name + " w0"))
    produce = lambda w0, x: (w0 * x).exp()
    compiled_produce, compiled = kiln.compile(produce), kiln.compile(model)
    x, other = random_tensor(3, 4), random_tensor(3, 4)
    for output in (0, 1, 0):
        runs = kiln._C.compiler_stats()["autograd_backward_runs"]
        sides = (("kiln", compiled_produce, compiled, model), ("eager", produce, reference, reference))
        for name, make, fn, m in sides:
            h = make(m.w0, x)
            h.register_hook(doubling_hook(log, name + " h"))
            fn(h, other)[output].sum().backward()
        assert kiln._C.compiler_stats()["autograd_backward_runs"] - runs == (2 if output == 0 else 1)
        assert [e[1:] for e in log if e[0].startswith("kiln")] == [e[1:] for e in log if e[0].startswith("eager")], log
        log.clear()
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert_compiled_autograd(expect_graphs=2)


def test_hooks_of_parameters_reached_elsewhere_are_called_once():
    """A parameter whose compiled head gets no gradient but which the loss also reads outside the compiled call (a
    regulariser), or through a second call whose head is used: eager calls its hook once, with the sum. Setting the
    hooks aside for the whole pass when one compiled node's edge to it got no gradient skipped them."""
    torch.manual_seed(0)
    model = TwoLinearHeads()
    reference = copy.deepcopy(model)
    calls = {"kiln": [], "eager": []}
    for name, m in (("kiln", model), ("eager", reference)):
        m.a.weight.register_hook(doubling_hook(calls[name], "a"))
    compiled = kiln.compile(model)
    x, y = random_tensor(3, 4), random_tensor(3, 4)
    for name, fn, m in (("kiln", compiled, model), ("eager", reference, reference)):
        (fn(x)[1].sum() + (m.a.weight**2).sum()).backward()  # a regulariser
        (fn(x)[1].sum() + fn(y)[0].sum()).backward()  # a second call that uses head a
    assert calls["kiln"] == calls["eager"] == [("a", (4, 4))] * 2, calls
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert_compiled_autograd()


def test_hook_registered_in_compiled_code_on_an_output_no_gradient_reaches():
    """register_hook inside the compiled function breaks the graph there: the hooked tensor is an output of the first
    graph's autograd node, beside one the loss does reach. Eager never reaches the op that made it; its hook was
    called with None."""
    log = []
    hook = doubling_hook(log, "h")

    def f(x, w0, wa, wb):
        h = (w0 * x).exp()
        k = (w0 * x).cos()
        h.register_hook(hook)
        return (h @ wa).tanh(), (k @ wb).sin()

    torch.manual_seed(0)
    x = random_tensor(3, 4)
    params = [random_tensor(*shape, requires_grad=True) for shape in ((4,), (4, 4), (4, 4))]
    compiled = kiln.compile(f)
    for output in (1, 0, 1):
        results = {}
        for name, fn in (("kiln", compiled), ("eager", f)):
            fn(x, *params)[output].sum().backward()
            results[name] = log[:], [p.grad for p in params]
            log.clear()
            for p in params:
                p.grad = None
        assert results["kiln"][0] == results["eager"][0] == ([("h", (3, 4))] if output == 0 else []), results
        torch.testing.assert_close(results["kiln"][1], results["eager"][1])
    assert_compiled_autograd(expect_graphs=2)


def test_hook_of_an_input_used_only_without_gradient_is_not_called():
    """An input that requires grad but that the compiled function reads only where no gradient flows (a mask):
    eager's engine does not reach its grad_fn; the compiled graph's node has an edge to it."""
    log, y_grads = [], []
    f = lambda h, y: y * (h > 0)
    compiled = kiln.compile(f)
    w0, y = random_tensor(3, 4, requires_grad=True), random_tensor(3, 4, requires_grad=True)
    for fn in (compiled, f):
        h = w0 * 2
        h.register_hook(doubling_hook(log, "h"))
        fn(h, y).sum().backward()
        y_grads.append(y.grad)
        y.grad = None
    assert log == [] and w0.grad is None
    torch.testing.assert_close(*y_grads)
    assert_compiled_autograd()


def test_backward_twice_without_retain_graph_raises_like_eager():
    compiled = kiln.compile(lambda a: torch.tanh(a) * 2)
    out = compiled(r(3, 4)).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def test_autograd_grad():
    fn = lambda a, b: (torch.sigmoid(a) * b).sum(dim=1)
    a, b = r(4, 5), r(4, 5)
    (ga, gb) = torch.autograd.grad(kiln.compile(fn)(a, b).sum(), (a, b))
    (ea, eb) = torch.autograd.grad(fn(a, b).sum(), (a, b))
    torch.testing.assert_close(ga, ea)
    torch.testing.assert_close(gb, eb)
    assert_compiled_autograd()


class TwoHeads(nn.Module):
    """BERT's shape of outputs: hidden states and a pooler output that the loss may leave unused."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return h, self.pooler(h[:, 0])


def test_an_unused_output_gives_its_parameters_no_gradient_as_in_eager():
    # eager's engine never reaches the pooler: its grads stay None and AdamW leaves it alone (no weight decay)
    x = random_tensor(4, 3, 8)
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = TwoHeads()
        run = kiln.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            hidden, _ = run(x)
            hidden.pow(2).mean().backward()
            opt.step()
        assert model.pooler.weight.grad is None and model.pooler.bias.grad is None, compiled
        assert model.body.weight.grad is not None
        if compiled:  # the pooler's gradients, computed and dropped, took no place among the packed ones
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            for g in grads:
                shared = [h for h in grads if h.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()]
                assert g.untyped_storage().nbytes() == sum(packed_bytes(h) for h in shared)
        models.append(model)
    for (name, eager), compiled in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(compiled, eager, msg=name)
    # both outputs used: both heads get gradients
    torch.manual_seed(0)
    model = TwoHeads()
    hidden, pooled = kiln.compile(model)(x)
    (hidden.sum() + pooled.sum()).backward()
    assert model.pooler.weight.grad is not None
    assert_compiled_autograd()


class LossAndLogits(nn.Module):
    """Returns the loss and the logits, as a transformers model called with labels does; the loss alone is trained."""

    def __init__(self, hidden=16, vocab=64):
        super().__init__()
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, labels):
        logits = self.lm_head(torch.tanh(self.body(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)), logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_an_output_no_gradient_comes_for_is_not_added_into_the_backward(device, capfd):
    # The logits get no gradient: the first backward fills theirs with zeros, the next forward compiles the backward
    # without it (the sum `logits' gradient + the loss's` becomes the loss's), and later steps run that one.
    eager_model = LossAndLogits().to(device)
    model = copy.deepcopy(eager_model)
    compiled = kiln.compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager_model, model)]
    kiln.config.set_logs("perf")
    try:
        for step in range(4):
            x = random_tensor(3, 5, 16, device=device)
            labels = random_class_targets(15, 64, "none", device=device).view(3, 5)
            for run, opt in ((eager_model, opts[0]), (compiled, opts[1])):
                opt.zero_grad(set_to_none=True)
                loss, logits = run(x, labels)
                loss.backward()
                opt.step()
            assert kiln._C.compiler_stats()["autograd_backward_variants"] == (0 if step == 0 else 1)
    finally:
        kiln.config.set_logs("")
    err = capfd.readouterr().err
    assert "backward compiled again without the gradients of differentiable outputs 1 (none came; 1 sums" in err, err
    rtol, atol = tolerance(torch.float32)
    for (name, want), got in zip(eager_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)
    # Both outputs used again: the backward built for every gradient runs, and the gradients are eager's.
    x = random_tensor(3, 5, 16, device=device)
    labels = random_class_targets(15, 64, "none", device=device).view(3, 5)
    grads = []
    for run, m in ((eager_model, eager_model), (compiled, model)):
        m.zero_grad(set_to_none=True)
        loss, logits = run(x, labels)
        (loss + logits.pow(2).mean()).backward()
        grads.append([p.grad for p in m.parameters()])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert_compiled_autograd()


JOINT_CHILD = """
import sys, torch, kiln
sys.path.insert(0, {bench!r})
import seed_models
torch.manual_seed(0)
model = torch.nn.Sequential(*[seed_models.TransformerBlock(32, 4, 64) for _ in range(2)])
x = torch.randn(3, 5, 32)
kiln.compile(model)(x).pow(2).mean().backward()
compiled = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model(x).pow(2).mean().backward()
ok = all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-5) for a, p in zip(compiled, model.parameters()))
s = kiln._C.compiler_stats()
print(ok, s["joint_cache_hits"], s["graph_cache_hits"], s["graphs_fallback"], "sympy" in sys.modules)
"""


def test_a_new_process_reads_the_joint_graphs_back(tmp_path):
    # the second process runs no autodiff (no torch meta kernels: no sympy) and no code generation, same gradients
    import os
    import subprocess
    import sys
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "shared_cache"),
               PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
    code = JOINT_CHILD.format(bench=os.path.dirname(os.path.abspath(seed_models.__file__)))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout.split())
    assert runs[0][:4] == ["True", "0", "0", "0"], runs
    assert runs[1][:4] == ["True", "1", "2", "0"], runs  # the joint graphs, then both halves
    assert runs[1][4] == "False", "a warm training compile imported sympy"


def test_no_grad_call_runs_forward_only():
    fn = kiln.compile(lambda a: torch.relu(a) * 3)
    x = r(4, 5)
    fn(x)  # compiled with grad
    with torch.no_grad():
        out = fn(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.relu(x.detach()) * 3)


def test_compiled_summary_has_backward_kernels():
    graphs = []

    def keep(graph, example_inputs):
        compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
        graphs.append(kiln._C.compiled_graph_summary(compiled))
        return compiled

    fn = kiln.compile(lambda a, b: torch.relu(a * b + 1), backend=keep)
    a, b = r(64, 32), r(64, 32)
    fn(a, b).sum().backward()
    (summary,) = graphs
    assert summary["backend"] == "kiln_autograd", summary
    assert any(k.startswith("backward:") for k in summary["kernels"]), summary
    torch.testing.assert_close(a.grad, (b * ((a * b + 1) > 0)).detach())


def keep_summaries(graphs):
    def keep(graph, example_inputs):
        compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
        graphs.append(kiln._C.compiled_graph_summary(compiled))
        return compiled
    return keep


def test_linear_weight_gradient_has_the_weight_layout():
    # A Linear weight enters the graph as w.t(): its gradient must come out contiguous like eager's (computed
    # as (grad^T @ x)^T), not as a transposed view that AccumulateGrad would copy on every step.
    fn = lambda x, w, b: torch.relu(F.linear(x, w, b)).sum(dim=0)
    x, w, b = r(33, 40), r(24, 40), r(24)
    grads = torch.autograd.grad(kiln.compile(fn)(x, w, b).sum(), (x, w, b))
    expected = torch.autograd.grad(fn(x, w, b).sum(), (x, w, b))
    for name, got, want in zip("xwb", grads, expected):
        torch.testing.assert_close(got, want, msg=name)
        assert got.stride() == want.stride(), (name, got.stride(), want.stride())
    assert_compiled_autograd()


# Bias-style gradients: sums over the outer (row) dims, with odd sizes for the column-block tails, several
# outer loops, sizes past the parallel threshold, and a fused prologue whose result is also stored.
COLUMN_SUM_CASES = [
    ("bias_grad", lambda x, b: (x + b).pow(2), [(129, 67), (67,)]),
    ("bias_grad_3d", lambda x, b: (x * 2 + b).pow(2), [(3, 37, 515), (515,)]),
    ("wide_parallel", lambda x, b: (x + b).pow(2), [(300, 1030), (1030,)]),
    ("per_batch_columns_parallel", lambda x, b: (x + b).pow(2), [(6, 90, 70), (6, 1, 70)]),
    # RMSNorm as transformers' Llama writes it: its weight gradient is a sum over (0, 1) that keeps the dims
    ("rms_norm", lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), [(4, 33, 64), (64,)]),
]


@pytest.mark.parametrize("name,fn,shapes", COLUMN_SUM_CASES, ids=[c[0] for c in COLUMN_SUM_CASES])
def test_column_sum_gradients_match_eager(name, fn, shapes):
    graphs = []
    compiled = kiln.compile(fn, backend=keep_summaries(graphs))
    # Sums of hundreds of float32 terms: a different (blocked) summation order than eager's moves the result
    # by ~rows * eps * |term| absolute, more than the table's 1e-5 where the sum nearly cancels.
    assert_same_as_eager(fn, *[r(*s) for s in shapes], compiled=compiled, rtol=1e-4, atol=1e-4)
    (summary,) = graphs
    assert summary["backend"] == "kiln_autograd", summary
    assert "column reduction" in summary["source"]


def test_column_reduction_with_stores_along_rows_matches_eager():
    fn = lambda x, w: ((x * w - x.mean(0)) * 3, (x * w).sum(0), x.sum((0, 1)))
    with torch.no_grad():
        x, w = random_tensor(4, 301, 45), random_tensor(45)
        assert_same_as_eager(fn, x, w, grads=False, rtol=1e-4, atol=1e-4)


# ---- cross entropy and gather gradients (passes/lower_cross_entropy.h, decomp/decompose_gather.cpp) ------------
def assert_loss_runs_as_kernels(summary):
    """No log_softmax or nll_loss anywhere, and the gradient over the logits is one pointwise kernel (the gather's
    scatter fused with exp(x - lse) * g): no zero fill and scatter of its own."""
    assert summary["backend"] == "kiln_autograd", summary["fallback_reason"]
    externs = summary["externs"]
    assert not any(op in e for e in externs for op in ("nll_loss", "log_softmax", "scatter")), summary["plan"]
    assert not any("log_softmax" in k for k in summary["kernels"]), summary["plan"]
    # (a kernel's name lists its first ops only: the scatter_add may be past them)
    logits_grad = [k for k in summary["kernels"] if k.startswith("backward:") and "exp" in k]
    assert len(logits_grad) == 1 and ("scatter_add" in logits_grad[0] or "new_zeros" in logits_grad[0]), summary["plan"]


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_trains_without_saving_its_log_softmax(reduction, ignored):
    # 64 classes: the gradient kernel's rows are whole vectors (37: none is), both layouts' code checked.
    for classes in (64, 37):
        graphs = []
        kiln.reset()
        kiln._C.reset_compiler_stats()
        fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
        x, t = r(13, classes), random_class_targets(13, classes, ignored)
        assert_same_as_eager(fn, x, t, compiled=kiln.compile(fn, backend=keep_summaries(graphs)))
        assert_compiled_autograd()
        (summary,) = graphs
        assert_loss_runs_as_kernels(summary)
        # the forward saves per-row values only (logsumexp: 4 bytes a row), never an N x C tensor
        saved = kiln._C.compiler_stats()["autograd_saved_bytes"]
        assert saved <= 16 * 13, saved


class LanguageModelHead(nn.Module):
    """Hidden states -> vocabulary logits -> the causal LM loss as transformers computes it (logits upcast,
    shifted, flattened, cross entropy over the labels that are not -100)."""

    def __init__(self, hidden=16, vocab=64):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels):
        logits = self.lm_head(self.norm(hidden_states)).float()
        shift_logits = logits[:, :-1, :].contiguous().view(-1, logits.shape[-1])
        return F.cross_entropy(shift_logits, labels[:, 1:].contiguous().view(-1), ignore_index=-100)


def test_language_model_head_trains_with_its_loss_as_kernels():
    model = LanguageModelHead()
    graphs = []
    compiled = kiln.compile(model, backend=keep_summaries(graphs))
    for _ in range(2):  # fresh inputs through the guarded entry
        hidden, labels = random_tensor(3, 9, 16), random_class_targets(27, 64, "some").view(3, 9)
        assert_same_as_eager(model, hidden, labels, compiled=compiled)
    assert_compiled_autograd()
    (summary,) = graphs
    assert_loss_runs_as_kernels(summary)
    # the shifted logits are saved (the loss's backward reads them) and nothing else of their size: the rest is the
    # layer norm's output and statistics (about 1.9 KB) and per-row values
    saved = kiln._C.compiler_stats()["autograd_saved_bytes"]
    assert saved <= 24 * 64 * 4 + 2500, saved


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_gradient_with_one_index_per_slice_is_pointwise(dim):
    # x.gather(-1, idx[..., None]) as user code writes it: the gradient is where(iota == idx, grad, 0), one kernel
    x = r(6, 7, 5)
    index = torch.randint(0, x.shape[dim], tuple(1 if d == dim % 3 else n for d, n in enumerate(x.shape)))
    fn = lambda x, index: torch.gather(x, dim, index).sin() * 2  # noqa: E731
    graphs = []
    assert_same_as_eager(fn, x, index, compiled=kiln.compile(fn, backend=keep_summaries(graphs)))
    assert_compiled_autograd()
    (summary,) = graphs
    assert summary["externs"] == [], summary["plan"]
    assert any(k.startswith("backward:") and "scatter_add" in k for k in summary["kernels"]), summary["plan"]


def test_gather_gradient_with_repeated_indices_accumulates():
    # several picks of one element along the dim: their gradients add up (scatter_add stays an extern call)
    x = r(4, 6)
    index = torch.tensor([[0, 0, 5], [2, 2, 2], [1, 3, 1], [4, 0, 4]])
    fn = lambda x: torch.gather(x, 1, index) * torch.arange(1.0, 4.0)  # noqa: E731
    graphs = []
    assert_same_as_eager(fn, x, compiled=kiln.compile(fn, backend=keep_summaries(graphs)))
    assert_compiled_autograd()
    (summary,) = graphs
    assert "backward:aten::scatter_add.default" in summary["externs"], summary["plan"]


def train(model, make_optimizer, inputs, steps=20, compiled=True):
    run = kiln.compile(model) if compiled else model
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = run(inputs[step % len(inputs)]).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_transformer_blocks_adamw_loss_curve():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[seed_models.TransformerBlock(32, 4, 64) for _ in range(2)])
    reference = copy.deepcopy(model)
    inputs = [random_tensor(2, 6, 32) for _ in range(4)]
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
    kiln_losses = train(model, adamw, inputs)
    eager_losses = train(reference, adamw, inputs, compiled=False)
    torch.testing.assert_close(torch.tensor(kiln_losses), torch.tensor(eager_losses), rtol=1e-3, atol=1e-5)
    assert_compiled_autograd()


class SmallResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.stem(x)))
        x = torch.relu(self.bn2(self.conv(x)) + x)
        return self.head(x.mean(dim=(2, 3)))


def channels_last_reference(model):
    """Eager in the layout compiled autograd runs CUDA convolutions in (passes/channels_last.h): a copy of
    `model` with channels-last weights, and a function that lays inputs out the same way. NHWC and NCHW kernels
    sum in different orders (on CPU, oneDNN's gradients differ by about 1e-4 of their largest element, and 20
    momentum steps of a small BatchNorm net amplify that: eager NCHW and eager NHWC part at step 4). Against
    this reference the compiled gradients and loss curves agree to rounding."""
    reference = copy.deepcopy(model).to(memory_format=torch.channels_last)
    return reference, lambda x: x.contiguous(memory_format=torch.channels_last)


def assert_sgd_momentum_training_matches_eager(model, input_shape, buffer_rtol):
    """20 SGD+momentum steps compiled and eager from the same weights: equal loss curves and BatchNorm
    buffers (running statistics and num_batches_tracked), all on the compiled autograd path."""
    reference = copy.deepcopy(model)
    inputs = [random_tensor(*input_shape) for _ in range(4)]
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    kiln_losses = train(model, sgd, inputs)
    eager_losses = train(reference, sgd, inputs, compiled=False)
    torch.testing.assert_close(torch.tensor(kiln_losses), torch.tensor(eager_losses), rtol=1e-3, atol=1e-5)
    buffers = dict(model.named_buffers())
    for name, b in reference.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=buffer_rtol, atol=1e-5, msg=name)
    assert all(b.item() == 20 for name, b in buffers.items() if name.endswith("num_batches_tracked"))
    assert_compiled_autograd()  # BatchNorm's num_batches_tracked.add_(1) must not send it to the fallback


def test_resnet_style_sgd_batchnorm_train_loss_curve():
    torch.manual_seed(0)
    assert_sgd_momentum_training_matches_eager(SmallResNet().train(), (4, 3, 8, 8), buffer_rtol=1e-4)


def test_dropout_reproducible_under_manual_seed():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)).train()
    reference = copy.deepcopy(model)
    x = random_tensor(8, 16)
    torch.manual_seed(7)
    out = kiln.compile(model)(x)
    out.sum().backward()
    torch.manual_seed(7)
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ---- buffer updates: in-place ops on graph inputs that never require grad --------------------------------
def fallback_reason():
    stats = kiln._C.compiler_stats()
    assert stats["graphs_fallback"] >= 1, stats
    return stats["last_fallback_reason"]


def test_buffer_update_read_after_update_matches_eager():
    def fn(x, counter, stat):
        counter.add_(1)
        stat.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return torch.tanh(x) * stat + counter
    x = r(4, 5)
    buffers = (torch.tensor(3), random_tensor(5))
    ref_x, ref_buffers = x.detach().clone().requires_grad_(), tuple(b.clone() for b in buffers)
    out = kiln.compile(fn)(x, *buffers)
    out.sum().backward()
    expected = fn(ref_x, *ref_buffers)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, ref_x.grad)
    for got, want in zip(buffers, ref_buffers):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert buffers[0].item() == 4
    assert_compiled_autograd()


def test_buffer_update_written_back_on_every_call():
    fn = kiln.compile(lambda x, counter: torch.relu(x) * 2 + counter.add_(1) * 0)
    counter = torch.tensor(0)
    version = counter._version
    for _ in range(3):
        fn(r(3, 4), counter).sum().backward()
    assert counter.item() == 3
    assert counter._version > version  # written in place, as eager's add_ does
    assert_compiled_autograd()
    with torch.no_grad():  # a grad-free graph of its own (today on the eager interpreter): still updates
        fn(r(3, 4), counter)
    assert counter.item() == 4


def test_buffer_read_by_the_backward_before_its_update_is_refused():
    # eager saves `scale` for mul's backward, then add_ changes it: its backward raises; kiln must not hide that
    def fn(x, scale):
        y = x * scale
        scale.add_(1)
        return y
    x, scale = r(4, 5), random_tensor(5)
    out = kiln.compile(fn)(x, scale)
    assert "updates in place" in fallback_reason()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_buffer_update_returned_or_viewed_stays_refused():
    returned = lambda x, counter: (torch.tanh(x), counter.add_(1))
    counter = torch.tensor(5)
    out, same = kiln.compile(returned)(r(2, 3), counter)
    assert same is counter or same.data_ptr() == counter.data_ptr()
    assert counter.item() == 6
    assert "input updated in place" in fallback_reason()

    def viewed(x, stat):
        v = stat.view(1, 5)
        stat.add_(1)
        return x * v.sum()
    x, stat = r(4, 5), random_tensor(5)
    ref_x, ref_stat = x.detach().clone().requires_grad_(), stat.clone()
    kiln._C.reset_compiler_stats()
    kiln.compile(viewed)(x, stat).sum().backward()
    viewed(ref_x, ref_stat).sum().backward()
    assert "in-place op aten::add_" in fallback_reason()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(stat, ref_stat)


def test_update_of_input_that_requires_grad_stays_refused():
    def fn(x, w):
        y = x * 2
        y.add_(w)  # an intermediate: functionalized
        return y
    x, w = r(3, 4), r(3, 4)
    assert_same_as_eager(fn, x, w)
    assert_compiled_autograd()
    kiln._C.reset_compiler_stats()
    kiln.compile(lambda a, b: a.add_(b) * 2)(random_tensor(3, 4), r(3, 4))
    assert "in-place op aten::add_" in fallback_reason()


# ---- a torchvision-style ResNet (torchvision is not installed here) ----------------------------------------
class BasicBlock(torch.nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(planes)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                                  torch.nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(torch.nn.Module):
    """torchvision's resnet18 layout: conv7x7/2 + BN + ReLU + maxpool 3x3/2, four stages of two BasicBlocks
    (the first of stages 2-4 strided with a 1x1 downsample), adaptive average pool, fc."""

    def __init__(self, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), num_classes=1000):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(widths[0])
        self.relu = torch.nn.ReLU(inplace=True)
        self.maxpool = torch.nn.MaxPool2d(3, 2, 1)
        inplanes, stages = widths[0], []
        for i, (planes, count) in enumerate(zip(widths, blocks)):
            layers = []
            for j in range(count):
                layers.append(BasicBlock(inplanes, planes, 2 if i > 0 and j == 0 else 1))
                inplanes = planes
            stages.append(torch.nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = torch.nn.AdaptiveAvgPool2d((1, 1))
        self.fc = torch.nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def small_resnet18():
    torch.manual_seed(0)
    return ResNet(widths=(8, 16, 16, 32), num_classes=10).train()


def test_resnet18_train_gradients_and_buffers_match_eager():
    model = small_resnet18()
    reference = copy.deepcopy(model)
    x = random_tensor(4, 3, 32, 32)
    kiln.compile(model)(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    buffers = dict(model.named_buffers())
    for name, b in reference.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=1e-5, atol=1e-6, msg=name)
    assert buffers["layer3.0.downsample.1.num_batches_tracked"].item() == 1
    assert_compiled_autograd()
    assert kiln._C.compiler_stats()["autograd_saved_bytes"] > 0


def test_resnet18_sgd_momentum_loss_curve():
    assert_sgd_momentum_training_matches_eager(small_resnet18(), (4, 3, 32, 32), buffer_rtol=1e-3)


def grad_fn_names(output):
    """The names of every autograd node `output` was computed through."""
    names, stack, seen = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.cuda
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_cuda_padded_average_pooling_of_a_convolution_trains_like_eager(count_include_pad):
    """kiln lays CUDA convolution outputs out channels-last; ATen's CUDA avg_pool2d backward of a channels-last input
    with padding drops the padding offset before torch 2.12 (pytorch#188344). Such a backward runs on the input in
    the default layout: the gradients of a conv -> AvgPool2d(3, 2, 1) stack (torchvision's MaxViT, timm's Inception)
    were 92% off, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.AvgPool2d(3, 2, 1, count_include_pad=count_include_pad),
                          nn.Conv2d(16, 16, 1), nn.AvgPool2d(3, 1, 1, count_include_pad=count_include_pad)).cuda()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        assert_same_as_eager(model, random_tensor(2, 16, 12, 12, device="cuda", requires_grad=True))
    assert_compiled_autograd()


@pytest.mark.cuda
@pytest.mark.parametrize("compiled_autograd", [True, False], ids=["compiled_autograd", "eager_autograd"])
def test_cuda_resnet_training_runs_channels_last_with_cudnn_batch_norm(compiled_autograd):
    """On CUDA, training-mode batch norm runs cuDNN's kernels as eager's does (passes/use_cudnn_batch_norm.h),
    and under compiled autograd the captured graph is relaid channels-last before the split, so the forward
    saves its activations as it computes them (no fused kernel copies one back to the recorded layout).
    Gradients, running statistics and three SGD steps' losses match eager in the same layout."""
    kiln.config.set_compiled_autograd(compiled_autograd)
    torch.manual_seed(0)
    model = ResNet(widths=(16, 32, 32, 64), num_classes=10).cuda().train()
    # compiled autograd relays convolutions channels-last; the eager interpreter replays the recorded layout
    reference, lay_out = channels_last_reference(model) if compiled_autograd else (copy.deepcopy(model), lambda x: x)
    graphs = []
    compiled = kiln.compile(model, backend=keep_summaries(graphs))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for step in range(3):
            x = random_tensor(4, 3, 32, 32, device="cuda")
            out, expected = compiled(x), reference(lay_out(x))
            if step == 0:
                assert "CudnnBatchNormBackward0" in grad_fn_names(expected)
                if not compiled_autograd:  # the eager interpreter's replay records eager's own nodes
                    assert "CudnnBatchNormBackward0" in grad_fn_names(out)
            loss, expected_loss = out.pow(2).mean(), expected.pow(2).mean()
            torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-6)
            opt.zero_grad()
            ref_opt.zero_grad()
            loss.backward()
            expected_loss.backward()
            if step == 0:
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
            opt.step()
            ref_opt.step()
    buffers = dict(model.named_buffers())
    for name, b in reference.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=1e-4, atol=1e-5, msg=name)
    assert buffers["bn1.num_batches_tracked"].item() == 3
    (summary,) = graphs
    if compiled_autograd:
        assert summary["backend"] == "kiln_autograd", summary.get("fallback_reason")
        assert "forward:aten::cudnn_batch_norm.default" in summary["externs"], summary["externs"]
        assert "backward:aten::cudnn_batch_norm_backward.default" in summary["externs"], summary["externs"]
        assert not any("native_batch_norm" in e for e in summary["externs"]), summary["externs"]
        # (the head's global average pool reads the last activation through a layout restore fused into its
        # mean's kernel: `..._relu_clone_mean`, nothing stored)
        copies_back = [k for k in summary["kernels"]
                       if k.startswith("forward:") and "relu_clone" in k and not k.endswith("_mean")]
        assert not copies_back, copies_back
    else:
        assert summary["backend"] == "eager", summary


@pytest.mark.cuda
def test_cuda_resnet_training_under_bf16_autocast_is_one_channels_last_graph():
    """Under bfloat16 autocast batch norm is ATen's native kernel (cuDNN's takes float32 and half inputs), run
    channels-last after the relaid convolutions. Its backward gets the gradient in the input's layout: with a
    gradient in the default layout ATen takes a slow mixed-layout path and returns a layout its meta kernel does not
    say. In-place ReLUs after the batch norms keep the model one graph. Loss and gradients match eager in the same
    layout within bfloat16's tolerance."""
    torch.manual_seed(0)
    model = ResNet(widths=(16, 32, 32, 64), num_classes=10).cuda().train()
    reference, lay_out = channels_last_reference(model)
    graphs = []
    compiled = kiln.compile(model, backend=keep_summaries(graphs))
    x = random_tensor(4, 3, 32, 32, device="cuda")
    losses = []
    for fn, inp in ((compiled, x), (reference, lay_out(x))):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(inp).float().pow(2).mean()
        loss.backward()
        losses.append(loss)
    rtol, atol = tolerance(torch.bfloat16)
    torch.testing.assert_close(losses[0], losses[1], rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=10 * rtol, atol=10 * atol, msg=name)
    assert kiln.stats()["graph_breaks"] == 0, kiln.stats()
    (summary,) = graphs
    assert summary["backend"] == "kiln_autograd", summary.get("fallback_reason")
    assert "backward:aten::native_batch_norm_backward.default" in summary["externs"], summary["externs"]


def test_batch_norm_backward_gets_its_gradient_in_the_input_layout():
    """A channels-last batch norm input whose gradient arrives in the default layout (here through .contiguous()):
    the backward lays the gradient out as the input, a copy fused into the kernel that makes the gradient."""
    bn = nn.BatchNorm2d(8).train()

    def fn(x):
        return bn(x).contiguous().sin()

    x = random_tensor(2, 8, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    graphs = []
    actual = kiln.compile(fn, backend=keep_summaries(graphs))(x)
    reference = copy.deepcopy(bn)
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(x_ref).contiguous().sin()
    torch.testing.assert_close(actual, expected)
    (grad,) = torch.autograd.grad(actual.sum(), x)
    (grad_ref,) = torch.autograd.grad(expected.sum(), x_ref)
    torch.testing.assert_close(grad, grad_ref)
    (summary,) = graphs
    assert summary["backend"] == "kiln_autograd", summary.get("fallback_reason")
    assert any(k.startswith("backward:") and "clone" in k for k in summary["kernels"]), summary["kernels"]


def test_a_view_of_an_updated_buffer_passed_alongside_sees_the_update():
    # The forward updates b in place; v views b. Eager's update shows through v; the compiled graph reads v as
    # its own buffer, so such a call runs on the eager interpreter (checked per call).
    def f(w, b, v):
        b.add_(1)
        return (w * v.sum()).sum()

    base = random_tensor(4)
    w_eager = random_tensor(3, requires_grad=True)
    w_kiln = w_eager.detach().clone().requires_grad_(True)
    b_eager, b_kiln = base.clone(), base.clone()
    expected = f(w_eager, b_eager, b_eager[:2])
    actual = kiln.compile(f)(w_kiln, b_kiln, b_kiln[:2])
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(b_kiln, b_eager)
    actual.backward()
    expected.backward()
    torch.testing.assert_close(w_kiln.grad, w_eager.grad)


# --- attention: scaled_dot_product_attention becomes a kernel with a backward (passes/lower_attention.h) ---

@pytest.mark.parametrize("causal", [False, True])
def test_attention_trains_on_compiled_autograd(device, causal):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3) * 2

    shapes = [(2, 3, 7, 16), (2, 3, 9 if not causal else 7, 16), (2, 3, 9 if not causal else 7, 16)]
    assert_same_as_eager(attend, *[random_tensor(*s, requires_grad=True, device=device) for s in shapes])
    assert_compiled_autograd()


class CrossAttention(nn.Module):
    """An encoder-decoder attention block written the way Whisper's is: q/k/v projections viewed into heads and
    made contiguous, attention, then transpose(1, 2).contiguous().reshape and an output projection."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, memory):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2).contiguous()
        k = self.k(memory).view(b, -1, self.heads, q.shape[-1]).transpose(1, 2).contiguous()
        v = self.v(memory).view(b, -1, self.heads, q.shape[-1]).transpose(1, 2).contiguous()
        a = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        a = a.transpose(1, 2).contiguous().reshape(b, n, -1).contiguous()
        return self.o(a)


def test_attention_over_contiguous_heads_trains_with_views_after_it(device):
    """Regression: ATen's attention kernels lay their output out by their inputs' layout (CPU flash attention
    returns contiguous heads for contiguous q/k/v), not always as recorded; the views after the lowered kernel
    then raised 'view size is not compatible' in a training step (Whisper's decoder, CPU)."""
    torch.manual_seed(0)
    model = CrossAttention().to(device)
    for target in (8, 16):
        x = random_tensor(2, 8, 64, requires_grad=True, device=device)
        memory = random_tensor(2, target, 64, requires_grad=True, device=device)
        assert_same_as_eager(model, x, memory)
    assert_compiled_autograd()


def test_attention_mask_that_masks_nothing_is_dropped():
    """A mask built in the graph that keeps everything (transformers builds one from an all-ones attention mask while
    compiling) is dropped at compile time, so the fused kernel and its backward apply: in bfloat16, where the math
    backward is refused, the graph still compiles its autograd."""
    def attend(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
        bias = torch.zeros(q.shape[-2], k.shape[-2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out + F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))

    q, k, v = (random_tensor(2, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    assert_same_as_eager(attend, q, k, v)
    assert_compiled_autograd()


@pytest.mark.parametrize("mask_kind", ["bool_broadcast", "bool_full", "float_broadcast", "float_full", "bool_2d"])
@pytest.mark.parametrize("key_length", [7, 16])
def test_attention_with_a_mask_trains_on_compiled_autograd(device, mask_kind, key_length):
    """A masked attention (transformers' padding masks: bool or additive float, broadcast over heads and queries)
    becomes the fused kernel with the mask as its additive bias, as in eager: on CUDA the memory-efficient kernel,
    whose bias rows are padded to 16 elements where the key length is not a multiple of 16; on CPU flash attention.
    Before, the backward was the math one, which recomputed the probabilities (Llama's training step ran 0.84x
    torch.compile's on an H100)."""
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4).sin()

    b, h, lq, lk, d = 2, 3, 5, key_length, 8
    shape = {"broadcast": (b, 1, 1, lk), "full": (b, h, lq, lk), "2d": (lq, lk)}[mask_kind.split("_")[1]]
    keep = random_tensor(*shape, device=device) > -0.5
    keep[..., 0] = True  # every query keeps a key (a fully masked row is NaN in eager as here)
    mask = keep if mask_kind.startswith("bool") else torch.zeros(shape, device=device).masked_fill(~keep, -1e4)
    q = random_tensor(b, h, lq, d, requires_grad=True, device=device)
    k, v = (random_tensor(b, h, lk, d, requires_grad=True, device=device) for _ in range(2))
    graphs = []
    assert_same_as_eager(attend, q, k, v, mask, compiled=kiln.compile(attend, backend=keep_summaries(graphs)))
    assert_compiled_autograd()
    kernel = ("_scaled_dot_product_efficient_attention" if device == "cuda"
              else "_scaled_dot_product_flash_attention_for_cpu")
    (summary,) = graphs
    assert any(kernel + "_backward" in name for name in summary["externs"]), summary["externs"]


@pytest.mark.parametrize("bias_shape", ["heads", "full", "keys"])
def test_attention_with_a_learned_bias_trains_on_compiled_autograd(device, bias_shape):
    """An additive mask that requires grad (T5's relative position bias, broadcast over the batch): its gradient is the
    scores' gradient before the scale, summed to its shape. The graph ran on the eager interpreter."""
    def attend(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias + 0.5).sin()

    b, h, lq, lk, d = 2, 3, 5, 7, 8
    shape = {"heads": (1, h, lq, lk), "full": (b, h, lq, lk), "keys": (b, 1, 1, lk)}[bias_shape]
    q = random_tensor(b, h, lq, d, requires_grad=True, device=device)
    k, v = (random_tensor(b, h, lk, d, requires_grad=True, device=device) for _ in range(2))
    assert_same_as_eager(attend, q, k, v, random_tensor(*shape, requires_grad=True, device=device))
    assert_compiled_autograd()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_masked_attention_trains_on_compiled_autograd_on_cuda(dtype):
    """A padding mask under autocast (BERT's or GPT-2's training step in 16-bit): the math backward refuses reduced
    precision, so the whole graph ran on the eager interpreter; the memory-efficient kernel takes the mask as its
    bias in every dtype. Key length 37: the bias rows are padded."""
    def attend(x, w, mask):
        q, k, v = (x @ w).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2).tanh()

    x = random_tensor(2, 37, 64, requires_grad=True, device="cuda")
    w = (random_tensor(64, 192, device="cuda") * 0.2).requires_grad_()
    mask = torch.ones(2, 1, 37, 37, dtype=torch.bool, device="cuda").tril()
    mask[1, ..., 30:] = False
    compiled = kiln.compile(attend)
    with torch.autocast("cuda", dtype=dtype):
        actual, expected = compiled(x, w, mask), attend(x, w, mask)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    for got, want in zip(torch.autograd.grad(actual.float().sum(), (x, w)),
                         torch.autograd.grad(expected.float().sum(), (x, w))):
        torch.testing.assert_close(got, want, rtol=10 * rtol, atol=10 * atol)
    assert_compiled_autograd()


@pytest.mark.cuda
def test_attention_dropout_on_cuda_gives_eager_results():
    """Dropout inside attention on CUDA, on compiled autograd: one seed, the same elements dropped, the same
    gradients (the backward replays the forward's dropout from the RNG state the kernel returned)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    q, k, v = (random_tensor(2, 4, 64, 32, requires_grad=True, device="cuda") for _ in range(3))
    compiled = kiln.compile(attend)
    torch.manual_seed(1)
    expected = attend(q, k, v)
    torch.manual_seed(1)
    actual = compiled(q, k, v)
    torch.testing.assert_close(actual, expected)
    grads_expected = torch.autograd.grad(expected.sum(), (q, k, v))
    grads_actual = torch.autograd.grad(actual.sum(), (q, k, v))
    torch.testing.assert_close(grads_actual, grads_expected)
    assert_compiled_autograd()
    with torch.no_grad():  # dropout did drop: the result is not attention without it
        assert not torch.allclose(actual, F.scaled_dot_product_attention(q, k, v), atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("under_autocast", [False, True])
def test_half_precision_attention_trains_on_compiled_autograd_on_cuda(dtype, under_autocast):
    """16-bit attention on CUDA (ViT and BERT training under autocast) records the memory-efficient kernel and its
    backward; before, its graph needed the math backward, which refuses reduced precision, and the whole graph ran
    on the eager interpreter. Eager runs flash or cuDNN attention here: another kernel, within the dtype's
    tolerance."""
    def block(x, w):
        q, k, v = (x @ w).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2).tanh()

    x = random_tensor(2, 24, 64, requires_grad=True, device="cuda")
    w = random_tensor(64, 192, requires_grad=True, device="cuda") * 0.2
    w = w.detach().requires_grad_()
    if not under_autocast:
        x, w = (t.detach().to(dtype).requires_grad_() for t in (x, w))
    context = torch.autocast("cuda", dtype=dtype) if under_autocast else contextlib.nullcontext()
    compiled = kiln.compile(block)
    with context:
        actual, expected = compiled(x, w), block(x, w)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    for got, want in zip(torch.autograd.grad(actual.float().sum(), (x, w)),
                         torch.autograd.grad(expected.float().sum(), (x, w))):
        torch.testing.assert_close(got, want, rtol=10 * rtol, atol=10 * atol)
    assert_compiled_autograd()


def backward_steps_matching_eager(fn, *args):
    """Compiles fn, checks its output and its inputs' gradients against eager on compiled autograd, and returns
    the backward graph's kernels and extern calls ("backward:<name>")."""
    graphs = []
    actual = kiln.compile(fn, backend=keep_summaries(graphs))(*args)
    expected = fn(*args)
    rtol, atol = tolerance(torch.float32)  # DESIGN.md's table: fused reductions sum in another order
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    for got, want in zip(torch.autograd.grad(actual.sum(), args), torch.autograd.grad(expected.sum(), args)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert_compiled_autograd()
    (summary,) = graphs
    return [k for k in summary["kernels"] + summary["externs"] if k.startswith("backward:")]


def test_packed_projection_gradient_is_one_stack():
    # nn.MultiheadAttention splits one packed projection with proj[0], proj[1], proj[2]. Each select's gradient
    # is a zero-filled tensor of the whole projection with one slice written; summed, that is three fills,
    # three copies and two adds. The builder stacks the three gradients instead.
    def fn(x, w):
        proj = (x @ w).unflatten(-1, (3, 8)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = proj[0], proj[1], proj[2]
        return torch.tanh(q) * k + v.sigmoid()

    backward = backward_steps_matching_eager(fn, r(5, 16), r(16, 24))
    assert "backward:aten::stack.default" in backward and not any("select_backward" in k for k in backward), backward


def test_attention_head_gradients_are_stacked_without_reshape_copies():
    # nn.MultiheadAttention's general path: q/k/v are proj[i].view(L, B * H, D).transpose(0, 1), and the scores
    # are bmm(q, k.transpose(1, 2)). Each head gradient comes back as a transposed bmm result whose reshape to
    # (L, B, E) would copy; the stack reads them through views instead, and k's gradient is computed in k's own
    # layout (dense along its innermost dim) rather than transposed.
    L, B, H, D = 6, 2, 2, 4
    E = H * D

    def fn(x, w):
        proj = (x @ w).unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = (proj[i].view(L, B * H, D).transpose(0, 1) for i in range(3))
        attn = torch.bmm(q * 0.5, k.transpose(1, 2)).softmax(-1)
        return torch.bmm(attn, v).transpose(0, 1).reshape(L, B, E)

    backward = backward_steps_matching_eager(fn, r(L, B, E), r(E, 3 * E))
    assert backward.count("backward:aten::stack.default") == 1, backward
    # One reshape is left: the squeeze/transpose chain's, on the stacked result, where it is a view.
    assert backward.count("backward:aten::reshape.default") == 1 and not any("clone" in k for k in backward), backward


def test_recomputed_gelu_shares_the_gelu_backward_kernel():
    # The partitioner recomputes gelu(h) in the backward (for the second Linear's weight gradient) rather than
    # saving it; gelu_backward(grad, h) reads the same h. The two run as one kernel, reading h once.
    def ffn(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    backward = backward_steps_matching_eager(ffn, r(4, 8, 16), r(32, 16), r(32), r(16, 32), r(16))
    kernels = [k for k in backward if k.startswith("backward:kernel_")]
    assert any("gelu_backward" in k and "_gelu" in k.replace("gelu_backward", "") for k in kernels), backward


def test_swiglu_activation_and_product_share_a_kernel():
    # Llama's MLP: silu(gate(x)) * up(x). The silu was recorded before up's matmul and the product after it, and the
    # scheduler keeps graph order: two kernels, the silu written and read back. The silu now moves down to the
    # product and the two are one kernel, in inference and in the training step's forward.
    def mlp(x, gate, up, down):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    args = (r(4, 8, 16), r(32, 16), r(32, 16), r(16, 32))
    graphs = []
    assert_same_as_eager(mlp, *args, compiled=kiln.compile(mlp, backend=keep_summaries(graphs)))
    assert_compiled_autograd()
    forward = [k for k in graphs[0]["kernels"] if not k.startswith("backward:")]
    assert any("silu_mul" in k for k in forward), forward
    with torch.no_grad():
        graphs.clear()
        inference = kiln.compile(mlp, backend=keep_summaries(graphs))
        torch.testing.assert_close(inference(*args), mlp(*args))
    assert graphs[0]["kernels"] == ["kernel_0_silu_mul"], graphs[0]["kernels"]


@pytest.mark.parametrize("where", ["rows", "columns", "pairs", "after_a_slice", "by_a_matrix"])
def test_advanced_indexing_trains_on_compiled_autograd(where):
    # x[idx] records aten::index.Tensor, which had no derivative rule: the whole graph ran on the eager interpreter
    # (Whisper's training step). Its gradient accumulates into zeros at the indexed places; repeated indices sum.
    # Indexed by a matrix (Whisper's positions), the zeros' new_zeros has a gradient of higher rank as its `self`, which
    # the scheduler could not place ("does not fit its own kernel"): that fill stays an extern call.
    fn = {"rows": lambda x, i, j: (x[i] * 2).sin(),
          "by_a_matrix": lambda x, i, j: x[i.view(1, 5).expand(2, 5)].cos(),
          "columns": lambda x, i, j: x[:, i].exp(),
          "pairs": lambda x, i, j: x[i, j] * 3,
          "after_a_slice": lambda x, i, j: x.unsqueeze(0)[:, i, 1:].tanh()}[where]
    i, j = torch.tensor([0, 3, 3, 4, 1]), torch.tensor([4, 0, 0, 2, 2])
    assert_same_as_eager(fn, r(6, 5), i, j)
    assert_compiled_autograd()


def test_partly_selected_value_keeps_select_backward():
    # Only two of three slices get a gradient: no stack (the third slice's zeros still come from select_backward).
    def fn(x):
        return x[0] * 2 + x[2].tanh()

    assert_same_as_eager(fn, r(3, 4, 5))
    assert_compiled_autograd()


@pytest.mark.parametrize("compiled_autograd", [True, False])
def test_copy_into_an_intermediate_trains(compiled_autograd):
    # z.copy_(src) on an intermediate is recorded as functional aten::copy, which has no autograd formula in
    # PyTorch: the eager interpreter (eager autograd) raised "derivative for aten::copy is not implemented".
    def f(x, y):
        z = x * 2
        z.copy_(y.sin())
        return z * x

    previous = kiln._C.compiled_autograd()
    kiln._C.set_compiled_autograd(compiled_autograd)
    try:
        assert_same_as_eager(f, r(4, 3), r(4, 3))
    finally:
        kiln._C.set_compiled_autograd(previous)
    if compiled_autograd:
        assert_compiled_autograd()


def test_view_outputs_of_intermediates_train_on_compiled_autograd():
    # logits.view(-1), h.t() as the last step: returned as copies in the view's layout, on compiled autograd.
    assert_same_as_eager(lambda x, w: (x @ w).relu().view(-1), r(4, 5), r(5, 3))
    assert_compiled_autograd()
    kiln.reset()
    out = kiln.compile(lambda x, w: (x @ w).t())(r(4, 5), r(5, 3))
    assert out.stride() == (1, 3)
    assert_same_as_eager(lambda x, w: (x @ w).t(), r(4, 5), r(5, 3))
    assert_compiled_autograd()


def test_a_view_of_an_input_returned_aliases_it_on_compiled_autograd():
    # An output that views an input must alias it, as eager's does: the view is made again on the caller's tensor
    # (not a compiled autograd node's own tensor), and the rest of the graph stays compiled.
    def f(x, w):
        return x.view(-1), (x * w).sum()

    x = r(4, 5)
    out, _ = kiln.compile(f)(x, r(4, 5))
    assert out._base is x
    assert kiln._C.compiler_stats()["graphs_fallback"] == 0
    assert kiln._C.compiler_stats()["graphs_autograd"] == 1


def test_unbind_of_a_permuted_projection_stacks_in_the_projection_layout():
    # timm's attention: qkv = linear(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4); q, k, v = qkv.unbind(0).
    # The gradient is stacked straight into the projection's layout, so the reshape back is a view: one copy
    # (the stack) instead of a stack and a reshape copy.
    B, N, H, D = 2, 5, 3, 4

    def attend(x, w):
        q, k, v = (x @ w).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v

    graphs = []
    # float64: a peaked softmax makes float32 gradients depend on the summation order past the tolerance
    x, w = (random_tensor(*s, dtype=torch.float64, requires_grad=True) for s in ((B, N, H * D), (H * D, 3 * H * D)))
    actual = kiln.compile(attend, backend=keep_summaries(graphs))(x, w)
    expected = attend(x, w)
    rtol, atol = tolerance(torch.float64, "general")
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    for got, want in zip(torch.autograd.grad(actual.sum(), (x, w)), torch.autograd.grad(expected.sum(), (x, w))):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert_compiled_autograd()
    (summary,) = graphs
    backward = [k for k in summary["kernels"] + summary["externs"] if k.startswith("backward:")]
    assert backward.count("backward:aten::stack.default") == 1, backward
    assert not any("reshape" in k or "clone" in k for k in backward), backward


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape,normalized", [((6, 33), (33,)), ((2, 5, 4, 7), (4, 7)), ((3, 1, 16), (16,))])
def test_layer_norm_backward_is_generated_code(shape, normalized, affine):
    # float32 layer norm's input gradient as plain ops (one row-reduction kernel, fused with what surrounds it);
    # ATen's kernel computes only the weight and bias gradients.
    ln = nn.LayerNorm(normalized, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    graphs = []
    x = r(*shape)
    fn = lambda x: ln(x * 1.5).tanh()
    out = kiln.compile(fn, backend=keep_summaries(graphs))(x)
    expected = fn(x)
    params = [x] + list(ln.parameters())
    rtol, atol = tolerance(torch.float32, "general")
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for got, want in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(expected.sum(), params)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert_compiled_autograd()
    (summary,) = graphs
    backward = [k for k in summary["kernels"] + summary["externs"] if k.startswith("backward:")]
    # the weight and bias gradients come from ATen's kernel with the input gradient masked off
    assert sum("native_layer_norm_backward" in k for k in backward) == (1 if affine else 0), backward


def _positional_table(x):
    n, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(n, dtype=x.dtype).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=x.dtype) * -0.5)
    table = torch.zeros(n, d)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return x + table


def _writes_read_back(x, y):
    out = torch.zeros(4, 5)
    row = out[1]
    before = row.sum()
    out[1] = x[0]
    out[2:4, 1:3] += x[1:3, :2]
    out[0] = out[1] + y[0]  # (a product would save out[1], which the write then changes: eager raises)
    return out * 2, row * 3, before


@pytest.mark.parametrize("name,fn,shapes", [
    ("positional_table", _positional_table, [(2, 6, 8)]),
    ("slices_of_a_new_tensor", lambda a, b: torch.cat([a, b], 1).sin() + _writes_into(a, b), [(3, 4), (3, 2)]),
    ("writes_read_back", _writes_read_back, [(4, 5), (4, 5)]),
    ("circular_padding", lambda x: F.pad(x, (1, 2), mode="circular").sin() + 0, [(2, 3, 5)]),
    ("circular_padding_2d", lambda x: F.pad(x, (1, 1, 2, 0), mode="circular") * 3, [(2, 3, 4, 5)]),
    ("index_and_mask_writes", lambda x, v: _index_writes(x, v), [(5, 3), (2, 3)]),
    ("in_place_on_the_tensor_after_its_slices", lambda x: _shifted_right(x), [(3, 6)]),
    ("zeroed_slice_of_a_cloned_bias", lambda x, w, b: _zeroed_key_bias(x, w, b), [(3, 4), (6, 4), (6,)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_writes_into_slices_of_new_tensors_stay_compiled(name, fn, shapes):
    """`t[i] = v`, `t[a:b] += v` and ATen's own slice copies (circular padding) on tensors the graph made become
    slice/select scatters (passes/functionalize.cpp): one graph on compiled autograd with eager's gradients."""
    assert_same_as_eager(fn, *[r(*s) for s in shapes])
    assert_compiled_autograd()
    assert kiln.stats()["graph_breaks"] == 0


def _writes_into(a, b):
    out = torch.empty(a.shape[0], a.shape[1] + b.shape[1])
    out[:, :a.shape[1]] = a.relu()
    out[:, a.shape[1]:] = b * 2
    return out


def _shifted_right(x):
    # BART's shift_tokens_right, over floats: slices written, then the tensor itself updated in place (the graph ran
    # on the eager interpreter: "in-place op aten::masked_fill_"), a view taken before the update read after it.
    out = x.new_zeros(x.shape)
    out[:, 1:] = x[:, :-1].clone()
    out[:, 0] = 2.0
    first = out[:, 0]
    out.masked_fill_(out > 1.0, 1.0)
    return out.sin(), first * 3


def _zeroed_key_bias(x, w, b):
    # torchvision's Swin V2: the key third of a cloned qkv bias zeroed in place (`zero_` made functional had no
    # derivative rule: the training graph ran on the eager interpreter).
    bias = b.clone()
    third = bias.numel() // 3
    bias[third:2 * third].zero_()
    return F.linear(x, w, bias).sin()


def _index_writes(x, v):
    y = x * 1
    y[torch.tensor([0, 3])] = v
    y[y > 1] = 0.5
    return y


def test_a_write_through_a_reshaped_view_keeps_eager_semantics():
    def f(x):
        out = torch.zeros(2, 3)
        flat = out.view(-1)
        out[0] = x[0]
        return flat * 1, out

    assert_same_as_eager(f, r(2, 3))  # the reshape aliases the base: the graph keeps its in-place write


def _relative_positions_added(q, k, rel, sp):
    # timm's MViTv2: `attn[:, :, sp:, sp:] = (attn[:, :, sp:, sp:].view(B, -1, h, w, h, w) + ...).view(...)` on the
    # output of a 4-d matmul (a bmm's `_unsafe_view`), with sp 0 (no class token: a write of the whole) or 1.
    attn = q @ k.transpose(-2, -1)
    b, heads, n, _ = attn.shape
    side = rel.shape[0]
    grid = attn[:, :, sp:, sp:].view(b, -1, side, side, side, side) + rel.view(1, 1, side, side, 1, 1)
    attn[:, :, sp:, sp:] = grid.view(b, -1, side * side, side * side)
    return attn.softmax(-1)


def _views_read_after_writes(x):
    # Views made before a write and read after it see the write, as in eager: those writes stay in place.
    y = x @ x.transpose(-2, -1)
    flat = y.view(-1)
    y.mul_(2)
    z = (x * 3).unsqueeze(0)
    t = z.transpose(1, 2)
    z[:, 1:] = z[:, 1:] + 1
    return flat * 1, t * 1, y.sum() + z.sum()


def _views_read_before_writes(x):
    # Views read only before the write: the write becomes functional.
    y = (x.unsqueeze(0) @ x.transpose(-2, -1).unsqueeze(0))
    before = y.view(-1).sum()
    y.add_(before)
    z = x * 3
    total = z.t().sum(0)
    z[1:] = z[1:] + total[1:, None].sum()
    return y.sin(), z.cos()


@pytest.mark.parametrize("name,fn,shapes", [
    ("relative_positions_whole", lambda q, k, rel: _relative_positions_added(q, k, rel, 0), [(2, 2, 4, 3)] * 2 + [(2, 2)]),
    ("relative_positions_after_a_token", lambda q, k, rel: _relative_positions_added(q, k, rel, 1),
     [(2, 2, 5, 3)] * 2 + [(2, 2)]),
    ("views_read_before_writes", _views_read_before_writes, [(4, 4)]),
    # torchvision's Swin V2: its position-bias MLP runs `nn.ReLU(inplace=True)` on a Linear of a 4-d table, whose
    # output is a view of the addmm (the graph ran on the eager interpreter: "in-place op aten::relu_").
    ("in_place_relu_on_a_linear_of_4d", lambda t, w, b: F.linear(F.relu_(F.linear(t, w, b)), w.t()).sin(),
     [(1, 3, 3, 2), (5, 2), (5,)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_writes_whose_earlier_views_are_read_before_them_stay_compiled(name, fn, shapes):
    """A write into a tensor some reshape or transpose viewed earlier is functional when that view is read only
    before the write (passes/functionalize.cpp's alias_last_read): MViTv2's relative positions trained on the eager
    interpreter ("autodiff: in-place op aten::copy_")."""
    assert_same_as_eager(fn, *[r(*s) for s in shapes])
    assert_compiled_autograd()
    assert kiln.stats()["graph_breaks"] == 0


def test_writes_whose_earlier_views_are_read_after_them_keep_eager_semantics():
    assert_same_as_eager(_views_read_after_writes, r(3, 4))


def test_safe_softmax_differentiates_with_rows_of_minus_inf(fresh_kiln, device):
    """_safe_softmax (nn.MultiheadAttention's math path): 0 for a row of -inf, and 0 gradient there, as in eager."""
    def f(x):
        return torch.ops.aten._safe_softmax(x, -1) * 3

    x = random_tensor(4, 6, 8, device=device)
    x[1, 2] = float("-inf")
    x[2, :, :3] = float("-inf")
    x.requires_grad_(True)
    kiln._C.reset_compiler_stats()
    assert_same_as_eager(f, x)
    stats = kiln._C.compiler_stats()
    assert stats["graphs_autograd"] == 1 and stats["graphs_fallback"] == 0, stats["last_fallback_reason"]
