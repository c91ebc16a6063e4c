"""Tracing under torch.autocast: the graph holds autocast's casts, exactly as eager makes them.

kiln records ops on meta tensors, which autocast's dispatch keys skip; under autocast each recorded call runs
on device proxies instead (kiln/_fake.py), so autocast's own kernels decide every cast. These tests run CPU
autocast (bfloat16 and float16) against eager: outputs with their dtypes, gradients, graph counts.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor, tolerance


def autocast_cpu(dtype=torch.bfloat16):
    return torch.autocast("cpu", dtype=dtype)


def autocast_on(device, dtype=torch.bfloat16):
    return torch.autocast(device, dtype=dtype)


def mixed_policies(x, w, b):
    projected = F.linear(x, w, b)  # lower precision
    h = F.gelu(projected)  # in its input's dtype
    h = F.layer_norm(h, h.shape[-1:])
    s = torch.softmax(h @ h.transpose(-1, -2), -1)
    y = torch.cat([s, x[..., :2]], -1)  # a float32 slice next to a bfloat16 tensor: promoted
    return y.exp().sum(-1), h, F.mse_loss(h.float(), x), projected


def assert_gradients_as_accurate_as_eager(fn, compiled, args, device, dtype):
    """Gradients of sum(outputs) under autocast, kiln's against eager's: eager's backward rounds to the lower
    precision after every op, kiln's fused kernels once, so the two differ by several roundings (up to 0.03 in
    bfloat16 on 60 random seeds). Checked instead: both close at ten times the dtype's tolerance, and kiln no
    further from the float32 gradient (the same function without autocast) than eager plus one tolerance."""
    def grads(f):
        leaves = [a.detach().clone().requires_grad_() for a in args]
        with autocast_on(device, dtype):
            outputs = f(*leaves)
        return torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves)

    eager, actual = grads(fn), grads(compiled)
    # the reference: the same function in float32 without autocast (float64 would meet the function's own .float())
    leaves32 = [a.detach().clone().requires_grad_() for a in args]
    exact = [g.double() for g in torch.autograd.grad(sum(o.sum() for o in fn(*leaves32)), leaves32)]
    rtol, atol = tolerance(dtype)
    for got, want, true in zip(actual, eager, exact):
        torch.testing.assert_close(got, want, rtol=10 * rtol, atol=10 * atol)
        kiln_error = (got.double() - true).abs().max().item()
        eager_error = (want.double() - true).abs().max().item()
        assert kiln_error <= eager_error + atol + rtol * true.abs().max().item(), (kiln_error, eager_error)


def assert_one_graph(fn, *args):
    result = kiln.explain(fn)(*args)
    assert result.graph_count == 1 and result.graph_break_count == 0, result
    return result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_function_called_under_autocast_matches_eager(fresh_kiln, device, dtype):
    args = (random_tensor(4, 8, requires_grad=True, device=device), random_tensor(8, 8, requires_grad=True, device=device),
            random_tensor(8, requires_grad=True, device=device))
    compiled = kiln.compile(mixed_policies)
    # The float32 results are computed from lower-precision ones: a 1-ulp difference there (a fused kernel rounds
    # once where ATen rounds per op) moves them by the lower precision's tolerance, not float32's.
    rtol, atol = tolerance(dtype)
    with autocast_on(device, dtype):
        for _ in range(2):
            outputs = assert_same_as_eager(mixed_policies, *args, compiled=compiled, rtol=rtol, atol=atol, grads=False)
        assert outputs[3].dtype == dtype  # the casts are in the graph, not lost on meta tensors
        stats = kiln.stats()
        assert stats["frames_compiled"] == 1 and stats["fallbacks"] == 0, stats
        ops = assert_one_graph(mixed_policies, *args).ops_per_graph[0]
    assert "aten::_to_copy.default" in ops, ops
    assert_gradients_as_accurate_as_eager(mixed_policies, compiled, args, device, dtype)


def test_autocast_dtype_and_state_are_guarded(fresh_kiln):
    x, w = random_tensor(4, 4), random_tensor(4, 4)

    def matmul_relu(a, b):
        return (a @ b).relu()

    compiled = kiln.compile(matmul_relu)
    for context, dtype in ((autocast_cpu(torch.bfloat16), torch.bfloat16), (autocast_cpu(torch.float16), torch.float16),
                           (torch.autocast("cpu", enabled=False), torch.float32)):
        with context:
            out = assert_same_as_eager(matmul_relu, x, w, compiled=compiled)
            assert out.dtype == dtype
    assert kiln.stats()["frames_compiled"] == 3 and kiln.stats()["fallbacks"] == 0, kiln.stats()
    with autocast_cpu(torch.bfloat16):  # the first entry serves again
        assert compiled(x, w).dtype == torch.bfloat16
    assert kiln.stats()["frames_compiled"] == 3


class AttentionBlock(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = [z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v)]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.norm2(x))


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_attention_block_forward_and_backward_under_autocast(fresh_kiln, device, compiled_autograd):
    kiln.config.set_compiled_autograd(compiled_autograd)
    try:
        torch.manual_seed(0)
        block = AttentionBlock().to(device)
        compiled = kiln.compile(block)
        rtol, atol = tolerance(torch.bfloat16)
        with autocast_on(device):
            for _ in range(2):
                x = random_tensor(2, 5, 16, device=device)
                out = compiled(x)
                torch.testing.assert_close(out, block(x), rtol=rtol, atol=atol)
            assert out.dtype == torch.float32  # the float32 residual stream promotes the bfloat16 branches
            assert_one_graph(block, random_tensor(2, 5, 16, device=device))
        # On CUDA kiln's attention is the memory-efficient kernel and eager's flash or cuDNN attention: in bfloat16
        # their gradients differ by roundings, so kiln's are held to eager's accuracy against float32.
        assert_gradients_as_accurate_as_eager(lambda x: (block(x),), lambda x: (compiled(x),),
                                              [random_tensor(2, 5, 16, device=device)], device, torch.bfloat16)
        assert kiln.stats()["fallbacks"] == 0, kiln.stats()
    finally:
        kiln.config.set_compiled_autograd(False)


def test_training_steps_under_autocast_follow_eager(fresh_kiln, device):
    """The AMP recipe: forward and loss under autocast, backward and optimizer step outside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    reference = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    data = [(random_tensor(16, 8, device=device), random_tensor(16, 4, device=device)) for _ in range(10)]
    losses = []
    for fn, opt in ((compiled, optimizers[0]), (reference, optimizers[1])):
        curve = []
        for x, target in data:
            opt.zero_grad()
            with autocast_on(device):
                loss = F.mse_loss(fn(x).float(), target)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=1e-3)
    assert kiln.stats()["fallbacks"] == 0, kiln.stats()


def test_graph_holds_no_device_proxy(fresh_kiln):
    """The proxies autocast runs on never leave the recorder: outputs are plain tensors."""
    def returns_several(x):
        values, indices = torch.max(x @ x, dim=0)
        return {"values": values, "pair": (indices, values.float())}

    compiled = kiln.compile(returns_several)
    with autocast_cpu():
        out = assert_same_as_eager(returns_several, random_tensor(4, 4))
        out = compiled(random_tensor(4, 4))
    for t in (out["values"], *out["pair"]):
        assert type(t) is torch.Tensor


# --- autocast blocks inside compiled code ------------------------------------------------------------------

def amp_inside(x, w):
    y = torch.relu(x) * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = y @ w
        with torch.autocast("cpu", enabled=False):
            exact = y @ w  # float32 again inside the inner block
        z = torch.softmax(z, -1)
    return z + 1, exact, z.dtype


def test_autocast_blocks_inside_compiled_code_are_one_graph(fresh_kiln):
    args = (random_tensor(4, 8, requires_grad=True), random_tensor(8, 8, requires_grad=True))
    compiled = kiln.compile(amp_inside)
    for _ in range(2):
        out = assert_same_as_eager(amp_inside, *args, compiled=compiled)
    assert out[2] == out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    assert_one_graph(amp_inside, *args)
    assert not torch.is_autocast_enabled("cpu")  # the trace left the thread's autocast state as it found it


SEEN_AT_BREAK = []


@kiln.disable
def note_autocast(t):
    """Runs in Python at a graph break: what autocast state does the code between two graphs see?"""
    SEEN_AT_BREAK.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), t.dtype))
    if t.shape[0] == 0:
        raise ValueError("empty batch")
    return t


def breaks_inside_amp(x, w):
    y = x.relu()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = y @ w
        z = note_autocast(z)  # a graph break inside a traced autocast block
        z = (z @ w).softmax(-1)  # the resume function is traced under autocast
    return z + 1, torch.is_autocast_enabled("cpu")


def test_break_inside_a_traced_autocast_block_resumes_compiled(fresh_kiln):
    args = (random_tensor(4, 8, requires_grad=True), random_tensor(8, 8, requires_grad=True))
    compiled = kiln.compile(breaks_inside_amp)
    SEEN_AT_BREAK.clear()
    for _ in range(2):
        # Gradients below: w is cast once per use here, once per block in eager (autocast's weight cache).
        out = assert_same_as_eager(breaks_inside_amp, *args, compiled=compiled, grads=False)
    assert out[0].dtype == torch.bfloat16 and out[1] is False
    eager_grads = torch.autograd.grad(breaks_inside_amp(*args)[0].float().sum(), args)
    kiln_grads = torch.autograd.grad(compiled(*args)[0].float().sum(), args)
    rtol, atol = tolerance(torch.bfloat16)
    for got, want in zip(kiln_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=10 * rtol, atol=10 * atol)
    # The code at the break ran inside the block, in eager and in kiln alike.
    assert SEEN_AT_BREAK == [(True, torch.bfloat16, torch.bfloat16)] * 6, SEEN_AT_BREAK
    stats = kiln.stats()
    assert stats["fallbacks"] == 0 and stats["graph_breaks"] >= 1, stats
    assert not torch.is_autocast_enabled("cpu")


def test_exception_at_a_break_inside_an_autocast_block_leaves_it(fresh_kiln):
    compiled = kiln.compile(breaks_inside_amp)
    compiled(random_tensor(4, 8), random_tensor(8, 8))
    with pytest.raises(ValueError, match="empty batch"):
        compiled(random_tensor(0, 8), random_tensor(8, 8))
    assert not torch.is_autocast_enabled("cpu")  # the block's __exit__ ran on the way out, as in eager


def prints_inside_nested_amp(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", enabled=False):
            z = x @ w
            note_autocast(z)  # inside two traced blocks: both entered again, outermost first
        z = z @ w  # back in the outer block: bfloat16
        note_autocast(z)
    return z, torch.is_autocast_enabled("cpu")


def test_break_inside_nested_autocast_blocks(fresh_kiln):
    args = (random_tensor(4, 8), random_tensor(8, 8))
    compiled = kiln.compile(prints_inside_nested_amp)
    SEEN_AT_BREAK.clear()
    for _ in range(2):
        out = assert_same_as_eager(prints_inside_nested_amp, *args, compiled=compiled)
    assert out[0].dtype == torch.bfloat16 and out[1] is False
    inner, outer = (False, torch.bfloat16, torch.float32), (True, torch.bfloat16, torch.bfloat16)
    assert SEEN_AT_BREAK == [inner, outer] * 4, SEEN_AT_BREAK
    assert kiln.stats()["fallbacks"] == 0, kiln.stats()
    assert not torch.is_autocast_enabled("cpu")


def item_inside_amp(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = x @ w
        if z.sum().item() > 1e9:  # data-dependent: the trace stops inside the block
            z = z * 2
    return z


def test_trace_stopping_inside_an_autocast_block_restores_the_state(fresh_kiln):
    args = (random_tensor(4, 8), random_tensor(8, 8))
    out = assert_same_as_eager(item_inside_amp, *args)
    assert out.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_autocast_manager_from_outside_is_not_entered_by_the_trace(fresh_kiln):
    manager = torch.autocast("cpu", dtype=torch.bfloat16)

    def uses_outer_manager(x):
        with manager:
            return x @ x

    out = assert_same_as_eager(uses_outer_manager, random_tensor(4, 4))
    assert out.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


class _ScaledSwish(torch.autograd.Function):
    """custom_fwd casts its inputs to float32 under autocast; custom_bwd runs the backward in the forward's state."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class _DisabledRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.a(x)  # lower precision
        with torch.autocast("cpu", enabled=False):
            h = torch.softmax(h.float(), -1) * 3  # float32, as the region asks
        return self.b(_ScaledSwish.apply(h)), h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_disabled_regions_and_custom_fwd_bwd_under_autocast(fresh_kiln, dtype):
    model = _DisabledRegion()
    x = random_tensor(4, 16, requires_grad=True)
    rtol, atol = tolerance(dtype)
    with autocast_cpu(dtype):
        out, region = assert_same_as_eager(model, x, rtol=10 * rtol, atol=10 * atol)
    assert region.dtype == torch.float32 and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_scaler_steps_follow_eager(fresh_kiln, device, dtype):
    """torch.amp.GradScaler around compiled training steps: the scale, the inf checks and a skipped step (the first
    scale overflows float16's gradients on purpose) as in eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
    reference = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model)
    data = [(random_tensor(16, 8, device=device), random_tensor(16, 4, device=device)) for _ in range(6)]
    runs = []
    for fn, m in ((compiled, model), (reference, reference)):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**17)  # float16: the first steps overflow and are skipped
        scales, losses = [], []
        for x, target in data:
            opt.zero_grad()
            with autocast_on(device, dtype):
                loss = F.mse_loss(fn(x).float(), target)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            losses.append(loss.item())
        runs.append((scales, losses, [p.detach().clone() for p in m.parameters()]))
    (scales, losses, params), (eager_scales, eager_losses, eager_params) = runs
    assert scales == eager_scales
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=2e-2, atol=1e-3)
    for got, want in zip(params, eager_params):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)


class _ResidualBlock(nn.Module):
    """torchvision's BasicBlock as written: in-place ReLU after batch norm, and `out += identity`."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # the first block's x is the float32 input: bfloat16 += float32
        return self.relu(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_ops_on_autocast_results_are_one_compiled_training_graph(fresh_kiln, device, dtype):
    """A result made under autocast is a non-leaf as in eager, so in-place ops on it trace (they used to break the
    graph at every in-place ReLU: 'a leaf Variable that requires grad is being used in an in-place operation'), and
    an in-place add whose operand promotes past its dtype is made functional with a cast back, so the graph is
    differentiated by kiln rather than run on the eager interpreter."""
    torch.manual_seed(0)
    model = nn.Sequential(_ResidualBlock(), _ResidualBlock()).to(device)
    reference = nn.Sequential(_ResidualBlock(), _ResidualBlock()).to(device)
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model)
    x = random_tensor(2, 8, 6, 6, device=device)
    before = kiln._C.compiler_stats()
    results = []
    for fn in (compiled, reference):
        with autocast_on(device, dtype):
            out = fn(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        results.append(out)
    stats, after = kiln.stats(), kiln._C.compiler_stats()
    assert stats["graph_breaks"] == 0 and stats["frames_compiled"] == 1, stats
    assert after["graphs_fallback"] == before["graphs_fallback"], after["last_fallback_reason"]
    assert after["graphs_autograd"] > before["graphs_autograd"]
    rtol, atol = tolerance(dtype)
    assert results[0].dtype == results[1].dtype == dtype
    torch.testing.assert_close(results[0], results[1], rtol=rtol, atol=atol)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=10 * rtol, atol=10 * atol, msg=name)
    for got, want in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inference_batch_norm_under_autocast_fuses_with_its_neighbours(fresh_kiln, device, dtype):
    """Inference batch norm of a 16-bit input (autocast's convolution output) with float32 statistics becomes
    pointwise float32 math and one cast back, as ATen computes it, fused with the ReLU and residual around it
    instead of running ATen's batch norm kernel."""
    torch.manual_seed(0)
    block = _ResidualBlock().to(device).eval()
    for bn in (block.bn1, block.bn2):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.normal_()
        bn.bias.data.normal_()
    x = random_tensor(2, 8, 6, 6, device=device).to(dtype)  # a 16-bit residual: no promotion past the branch
    graphs = []

    def keep(graph, example_inputs):
        compiled = kiln._C.compile_graph(graph, "kiln", example_inputs)
        graphs.append(kiln._C.compiled_graph_summary(compiled))
        return compiled

    with torch.no_grad(), autocast_on(device, dtype):
        actual, expected = kiln.compile(block, backend=keep)(x), block(x)
    rtol, atol = tolerance(dtype)
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    (summary,) = graphs
    assert summary["backend"] == "kiln", summary.get("fallback_reason")
    assert not any("batch_norm" in e for e in summary["externs"]), summary["externs"]


def _conv_group_norm(x, w, wg, bg):
    return (F.group_norm(F.conv2d(x, w, padding=1), 2, wg, bg).relu(),)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_norm_of_a_16_bit_input_with_float32_parameters_trains_like_eager(fresh_kiln, dtype):
    """CPU autocast runs a group norm on the 16-bit convolution output with the float32 weight and bias: ATen's mixed
    type, whose statistics are float32 and whose input gradient has the input's dtype, where torch's meta kernels
    say otherwise. The backward raised "expected scalar type BFloat16 but found Float" (timm's PoolFormerV2)."""
    args = (random_tensor(2, 4, 5, 5, requires_grad=True), random_tensor(6, 4, 3, 3, requires_grad=True),
            random_tensor(6, requires_grad=True), random_tensor(6, requires_grad=True))
    compiled = kiln.compile(_conv_group_norm)
    before = kiln._C.compiler_stats()
    assert_gradients_as_accurate_as_eager(_conv_group_norm, compiled, args, "cpu", dtype)
    after = kiln._C.compiler_stats()
    assert after["graphs_fallback"] == before["graphs_fallback"], after["last_fallback_reason"]
    assert after["graphs_autograd"] > before["graphs_autograd"]
