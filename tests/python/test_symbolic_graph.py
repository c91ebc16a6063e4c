"""Symbolic sizes on captured graphs (graph/propagate_symbolic_sizes, issue #25).

Each test captures a function with kiln._fake.Recorder at one size, marks the batch and/or sequence dims of its
inputs symbolic and propagates sizes through kiln's shape rules (the pass itself checks every symbolic meta against
the recorded one at the captured sizes). It then captures the same function at other sizes and evaluates the
symbolic graph there: either a guard (an assumption or a specialisation) fails, and the graph would recompile, or
every value's sizes, strides and offset equal the ones captured at those sizes.
"""
import pytest
import torch
import torch.nn.functional as F

from kiln import _C
from kiln._fake import Recorder


def capture(fn, inputs):
    rec = Recorder()
    fakes = [rec.add_input(t) for t in inputs]
    out = rec.call(fn, tuple(fakes), {})
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return rec.finish(outs)


def symbolic(fn, inputs, dynamic, others=(), int_args=()):
    """Captures fn(*inputs), propagates with `dynamic` ({input: [dims]}) and, for each input list in `others`,
    compares with the capture there. Returns (graph, summary, [guards failing at each of `others`])."""
    graph = capture(fn, inputs)
    summary = graph.propagate_symbolic_sizes(dynamic, list(int_args))
    graph.verify()
    for fmt in ("bytes", "json"):
        assert str(_C._graph_round_trip(graph, fmt)) == str(graph)
    failed = []
    for other in others:
        bindings = {s["name"]: other[s["input"]].shape[s["dim"]] for s in summary["symbols"]}
        got = graph.evaluate_sizes(bindings)
        failed.append(got["failed_assumptions"])
        if not got["failed_assumptions"]:  # (eager may raise where a guard fails: no capture there)
            expected = capture(fn, other)
            assert expected.ops() == graph.ops()
            want = expected.evaluate_sizes({})["metas"]
            for i, (g, w) in enumerate(zip(got["metas"], want)):
                assert g == w, f"value %{i}: symbolic graph gives {g} at {bindings}, capture gives {w}\n{graph}"
    return graph, summary, failed


def randn(*shapes):
    return [torch.randn(*s) for s in shapes]


def texts(summary, key="assumptions"):
    return [a["text"] for a in summary[key]]


# ---- propagated everywhere --------------------------------------------------------------------------------------
def test_pointwise_broadcasting_ties_equal_batch_dims():
    fn = lambda x, y, b: (x * y + b).relu()  # noqa: E731
    graph, s, failed = symbolic(fn, randn((4, 6, 8), (4, 1, 8), (8,)), {0: [0, 1], 1: [0, 1]},
                                others=[randn((5, 7, 8), (5, 1, 8), (8,)), randn((5, 7, 8), (3, 1, 8), (8,))])
    assert [x["name"] for x in s["symbols"]] == ["s0", "s1", "s2"]  # y's size-1 dim stays concrete
    assert s["assumptions"] == [{"text": "s0 == s2", "reason": "node 0 (aten::mul.Tensor): broadcast dim 0"}]
    assert s["values"][-1] == ["s0", "s1", "8"] and not s["specialisations"]
    assert failed == [[], ["s0 == s2"]]  # the second would raise in eager: the guard recompiles
    assert "%5 : f32[s0, s1, 8] = aten::relu.default(%4)" in str(graph)


def test_reductions_and_softmax():
    fn = lambda x: (x.sum(-1), x.mean(1, keepdim=True), x.amax(0), F.softmax(x, -1), F.log_softmax(x, 1))  # noqa
    _, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [0, 1]}, others=[randn((5, 9, 8)), randn((2, 3, 8))])
    assert s["values"][1:6] == [["s0", "s1"], ["s0", "1", "8"], ["s1", "8"], ["s0", "s1", "8"], ["s0", "s1", "8"]]
    assert failed == [[], []] and not s["assumptions"] and not s["specialisations"]


def test_layer_norm_saves_symbolic_statistics():
    fn = lambda x, w, b: F.layer_norm(x, (8,), w, b)  # noqa: E731
    graph, s, failed = symbolic(fn, randn((4, 6, 8), (8,), (8,)), {0: [0, 1]}, others=[randn((3, 11, 8), (8,), (8,))])
    assert "%4 : f32[s0, s1, 1]" in str(graph) and failed == [[]]


def test_linear_of_a_batch_is_addmm_over_the_symbol():
    _, s, failed = symbolic(F.linear, randn((4, 8), (16, 8), (16,)), {0: [0]}, others=[randn((7, 8), (16, 8), (16,))])
    assert s["values"][-1] == ["s0", "16"] and failed == [[]]


def test_linear_of_3d_input_infers_the_sizes_aten_computed():
    inputs, other = randn((4, 6, 8), (16, 8), (16,)), randn((5, 9, 8), (16, 8), (16,))
    # The recorder writes view(x, [24, 8]) and view(out, [4, 6, 16]) with concrete ints: the graph infers s0*s1 and
    # s0, s1 from the input's sizes, and records them as symbolic int arguments.
    graph, s, failed = symbolic(F.linear, inputs, {0: [0, 1]}, others=[other])
    assert not s["assumptions"] and not s["specialisations"] and failed == [[]]
    assert s["values"][-1] == ["s0", "s1", "16"] and "f32[s0*s1, 16]" in str(graph)
    assert s["int_args"] == [(0, 1, 0, "s0*s1"), (3, 1, 0, "s0"), (3, 1, 1, "s1")]
    # Ints a tracer marks are taken as they are (here the same expressions).
    _, marked, failed = symbolic(F.linear, inputs, {0: [0, 1]}, others=[other],
                                 int_args=[(0, 1, 0, "s0*s1"), (3, 1, 0, "s0"), (3, 1, 1, "s1")])
    assert marked["values"] == s["values"] and not marked["assumptions"] and failed == [[]]


def test_view_with_minus_one_over_the_sequence():
    fn = lambda x: x.view(4, -1, 2, 4).transpose(1, 2)  # noqa: E731  (b, t, h, d) -> (b, h, t, d)
    graph, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [1]}, others=[randn((4, 9, 8))])
    assert s["values"][-1] == ["4", "2", "s0", "4"] and failed == [[]]
    assert "f32[4, 2, s0, 4](s0*8, 4, 8, 1)" in str(graph)


def test_view_of_batch_size_read_as_an_int():
    fn = lambda x: x.view(x.shape[0], -1, 2, 4)  # noqa: E731
    # x.shape[0] reaches the graph as the int 4, unannotated: the view's first size is read as the batch it equals.
    _, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [0, 1]}, others=[randn((8, 6, 8)), randn((5, 9, 8))])
    assert s["values"][-1] == ["s0", "s1", "2", "4"] and not s["assumptions"] and failed == [[], []]
    # A tracer annotates the ints it passes: a literal 4 (annotated as a constant) stays 4, and -1 takes the rest.
    _, s, failed = symbolic(lambda x: x.view(4, -1, 2, 4), randn((4, 6, 8)), {0: [0, 1]},
                            others=[randn((8, 6, 8)), randn((5, 9, 8))], int_args=[(0, 1, 0, "4")])
    assert s["values"][-1] == ["4", "floordiv(s0*s1, 4)", "2", "4"] and texts(s) == ["s0*s1*8 % 32 == 0"]
    assert failed == [[], ["s0*s1*8 % 32 == 0"]]
    _, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [0, 1]}, others=[randn((8, 6, 8)), randn((5, 9, 8))],
                            int_args=[(0, 1, 0, "s0")])
    assert s["values"][-1] == ["s0", "s1", "2", "4"] and failed == [[], []]


def test_permute_transpose_and_contiguous_strides():
    fn = lambda x: x.permute(2, 0, 1).transpose(0, 1).contiguous()  # noqa: E731
    graph, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [0, 1]}, others=[randn((5, 9, 8))])
    text = str(graph)
    assert "f32[8, s0, s1](1, s1*8, 8)" in text and "%3 : f32[s0, 8, s1] = aten::clone" in text
    assert failed == [[]]


def test_non_contiguous_input_keeps_symbolic_strides():
    fn = lambda x: x * 2  # noqa: E731
    x = torch.randn(8, 6).t()  # strides (1, 6)
    graph, s, failed = symbolic(fn, [x], {0: [0, 1]}, others=[[torch.randn(9, 5).t()]])
    assert str(graph).startswith("graph(%0 : f32[s0, s1](1, s0)") and failed == [[]]


def test_slicing_clamps_with_min_and_steps_with_floordiv():
    fn = lambda x: (x[:, 1:-1], x[:, :3], x[:, ::2], x[1:], x.narrow(1, 1, 2))  # noqa: E731
    _, s, failed = symbolic(fn, randn((4, 6, 8)), {0: [0, 1]}, others=[randn((5, 9, 8)), randn((3, 4, 8))])
    assert s["values"][1:6] == [["s0", "s1 - 2", "8"], ["s0", "min(s1, 3)", "8"], ["s0", "floordiv(s1 + 1, 2)", "8"],
                                ["s0 - 1", "s1", "8"], ["s0", "min(s1, 3) - 1", "8"]]
    assert failed == [[], []]


def test_cat_adds_symbolic_lengths():
    fn = lambda x, y: torch.cat([x, y], 1)  # noqa: E731
    _, s, failed = symbolic(fn, randn((4, 6, 8), (4, 3, 8)), {0: [0, 1], 1: [0, 1]},
                            others=[randn((5, 9, 8), (5, 2, 8))])
    assert s["values"][-1] == ["s0", "s1 + s3", "8"] and texts(s) == ["s2 == s0"] and failed == [[]]


def test_embedding_of_symbolic_token_ids():
    fn = lambda i, w: F.embedding(i, w)  # noqa: E731
    _, s, failed = symbolic(fn, [torch.randint(0, 10, (4, 6)), torch.randn(10, 8)], {0: [0, 1]},
                            others=[[torch.randint(0, 10, (5, 9)), torch.randn(10, 8)]])
    assert s["values"][-1] == ["s0", "s1", "8"] and failed == [[]]


def test_convolution_output_sizes():
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=2)  # noqa: E731
    _, s, failed = symbolic(fn, randn((2, 3, 16, 12), (8, 3, 3, 3), (8,)), {0: [0, 2, 3]},
                            others=[randn((3, 3, 10, 15), (8, 3, 3, 3), (8,))])
    assert s["values"][-1] == ["s0", "8", "floordiv(s1 + 1, 2)", "floordiv(s2 + 1, 2)"] and failed == [[]]


def test_attention_recorded_whole():
    # Without a mask or is_causal, the recorder keeps scaled_dot_product_attention as one node.
    inputs = randn((2, 4, 6, 8), (2, 4, 10, 8), (2, 4, 10, 8))
    dynamic = {0: [0, 2], 1: [0, 2], 2: [0, 2]}
    graph, s, failed = symbolic(F.scaled_dot_product_attention, inputs, dynamic,
                                others=[randn((3, 4, 9, 8), (3, 4, 5, 8), (3, 4, 5, 8))])
    # The fused kernels' layout, as the recorder writes it; key and value tie to the query's batch.
    assert "f32[s0, 4, s1, 8](s1*32, 8, 32, 1) = aten::scaled_dot_product_attention.default" in str(graph)
    assert texts(s) == ["s2 == s0", "s4 == s0", "s5 == s3"] and failed == [[]]


# ---- sizes ATen's composites compute -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["matmul", "batched_matmul", "matmul_4d", "bmm", "flatten", "flatten_batch",
                                  "reshape", "expand_as", "linear_no_bias"])
def test_composites_of_3d_inputs_keep_batch_and_sequence_symbolic(name):
    b, t = {0: [0, 1]}, {0: [0, 2], 1: [0, 3]}
    fn, inputs, others, dynamic = {
        "matmul": (torch.matmul, randn((4, 6, 8), (8, 16)), randn((5, 9, 8), (8, 16)), b),
        "batched_matmul": (torch.matmul, randn((4, 6, 8), (4, 8, 6)), randn((5, 9, 8), (5, 8, 9)),
                           {0: [0, 1], 1: [0, 2]}),
        "matmul_4d": (torch.matmul, randn((4, 2, 6, 8), (4, 2, 8, 6)), randn((5, 2, 9, 8), (5, 2, 8, 9)), t),
        "bmm": (torch.bmm, randn((4, 6, 8), (4, 8, 6)), randn((5, 9, 8), (5, 8, 9)), {0: [0, 1], 1: [0, 2]}),
        "flatten": (lambda x: x.flatten(1), randn((4, 6, 8)), randn((5, 9, 8)), b),
        "flatten_batch": (lambda x: x.flatten(0, 1).relu(), randn((4, 6, 8)), randn((5, 9, 8)), b),
        "reshape": (lambda x: x.reshape(-1, 8), randn((4, 6, 8)), randn((5, 9, 8)), b),
        "expand_as": (lambda x, y: x.expand_as(y) + y, randn((4, 6, 1), (4, 6, 8)), randn((5, 9, 1), (5, 9, 8)),
                      {0: [0, 1], 1: [0, 1]}),
        "linear_no_bias": (F.linear, randn((4, 6, 8), (16, 8)), randn((5, 9, 8), (16, 8)), b),
    }[name]
    graph, s, failed = symbolic(fn, inputs, dynamic, others=[others])
    assert not s["specialisations"] and failed == [[]], str(graph)
    assert any("s" in size for size in s["values"][-1])
    for a in texts(s):  # only ties between the inputs' symbols, never an element count against a constant
        assert not any(side.isdigit() for side in a.split(" == ")), a


def test_ambiguous_unfolding_guards_instead_of_guessing():
    # Batch and sequence of equal hints: view(out, [6, 6, 16]) could split s0*s1 either way. The view keeps its
    # concrete sizes and guards the element count; the graph recompiles at other sizes rather than guess.
    graph, s, failed = symbolic(F.linear, randn((6, 6, 8), (16, 8), (16,)), {0: [0, 1]},
                                others=[randn((5, 7, 8), (16, 8), (16,)), randn((6, 6, 8), (16, 8), (16,))])
    assert texts(s) == ["576 == s0*s1*16"] and s["values"][-1] == ["6", "6", "16"]
    assert failed == [["576 == s0*s1*16"], []]
    assert s["int_args"] == [(0, 1, 0, "s0*s1")]  # (the first view folds s0*s1 unambiguously)


def test_sizes_0_and_1_stay_concrete():
    _, s, failed = symbolic(F.linear, randn((1, 6, 8), (16, 8), (16,)), {0: [0, 1]},
                            others=[randn((1, 9, 8), (16, 8), (16,))])
    assert [x["name"] for x in s["symbols"]] == ["s0"] and s["values"][-1] == ["1", "s0", "16"] and failed == [[]]
    graph = capture(lambda x: x.view(2, -1, 1).sum(-1), randn((4, 6)))  # a size 1 in the view: never inferred
    summary = graph.propagate_symbolic_sizes({0: [0, 1]})
    assert summary["values"][1] == ["2", "floordiv(s0*s1, 2)", "1"]
    # An empty batch: nothing is inferred from sizes 0, and the rules refuse empty views (specialised, as before).
    _, s, _ = symbolic(F.linear, randn((0, 6, 8), (16, 8), (16,)), {0: [0, 1]})
    assert s["values"][-1] == ["0", "6", "16"] and [p["symbol"] for p in s["specialisations"]] == ["s0"]


def test_views_of_non_contiguous_inputs_against_eager():
    # c10's computeStride over symbolic strides: views of permuted, sliced and expanded inputs that merge or split
    # dims, against eager on random sizes and layouts; reshape where no view exists (a copy).
    import random
    from test_shape_rules import STATS, Case, Sym, _run
    rng = random.Random(11)
    aten = torch.ops.aten
    answered_before = STATS["answered"]
    for _ in range(150):
        case = Case(rng)
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4))]
        x = case.tensor(shape)
        sizes, i = [], 0
        while i < len(shape):
            if i + 1 < len(shape) and rng.random() < 0.4:
                sizes.append(Sym(shape[i] * shape[i + 1], shape[i:i + 2]))
                i += 2
            elif shape[i] in (4, 6) and rng.random() < 0.4:
                sizes += [2, shape[i] // 2]
                i += 1
            else:
                sizes.append(Sym(shape[i], [shape[i]]) if shape[i] > 1 else 1)
                i += 1
        try:
            x.view([s.value if isinstance(s, Sym) else s for s in sizes])
        except RuntimeError:
            _run(aten.reshape.default, case, [x, sizes])
            continue
        _run(aten.view.default, case, [x, sizes])
    assert STATS["answered"] - answered_before > 300


def test_loss_and_attention_backward_rules_against_eager():
    import random
    from test_shape_rules import Case, _run
    rng = random.Random(12)
    aten = torch.ops.aten
    for _ in range(10):
        case = Case(rng)
        n, c = rng.choice([2, 5, 7]), rng.choice([3, 10])
        x = case.tensor([n, c], kind="contiguous")
        target = torch.randint(0, c, (n,))
        case.recipes[id(target)] = ("strided", [n], [0], [1], [0], {})
        for reduction in (0, 1, 2):
            out, total = aten.nll_loss_forward(x, target, None, reduction, -100)
            _run(aten.nll_loss_forward.default, case, [x, target, None, reduction, -100])
            grad = case.tensor(list(out.shape), kind="contiguous")
            case.recipes[id(total)] = ("strided", [], [], [], [], {})
            _run(aten.nll_loss_backward.default, case, [grad, x, target, None, reduction, -100, total])
        h, w = rng.choice([2, 3]), rng.choice([3, 4])
        x4 = case.tensor([n, c, h, w], kind="contiguous")
        t3 = torch.randint(0, c, (n, h, w))
        case.recipes[id(t3)] = ("strided", [n, h, w], [0, 1, 2], [1] * 3, [0] * 3, {})
        _run(aten.nll_loss2d_forward.default, case, [x4, t3, None, 0, -100])
        y = torch.log_softmax(x, 1)
        case.recipes[id(y)] = case.recipes[id(x)]
        _run(aten._log_softmax_backward_data.default, case, [case.tensor([n, c], kind="contiguous"), y, 1,
                                                              torch.float32])
        b, heads, length, kv = rng.randint(1, 3), rng.randint(1, 3), rng.choice([3, 7]), rng.choice([5, 8])
        q, k, v = (case.tensor(sh, kind=rng.choice(["contiguous", "permuted"]))
                   for sh in ([b, heads, length, 8], [b, heads, kv, 8], [b, heads, kv, 8]))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
        case.recipes[id(out)] = ("strided", list(out.shape), [0, 1, 2, 3], [1] * 4, [0] * 4, {})
        case.recipes[id(lse)] = ("strided", list(lse.shape), [0, 1, 2], [1] * 3, [0] * 3, {})
        if out.stride() != tuple(torch.empty(out.shape).stride()):
            continue  # (the recipe above describes contiguous outputs only)
        grad = case.tensor(list(out.shape), kind="contiguous")
        _run(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, case,
             [grad, q, k, v, out, lse, 0.0, False])
        meta = [torch.empty_strided(t.shape, t.stride(), device="meta") for t in (grad, q, k, v, out)]
        _run(aten._scaled_dot_product_efficient_attention_backward.default, case,
             [grad, q, k, v, None, out, case.tensor([b, heads, 32], kind="contiguous"), case.tensor([]),
              case.tensor([]), 0.0, [True, True, True, False]],
             expected=aten._scaled_dot_product_efficient_attention_backward.default(
                 *meta[:4], None, meta[4], torch.empty(b, heads, 32, device="meta"), torch.empty((), device="meta"),
                 torch.empty((), device="meta"), 0.0, [True, True, True, False]))


class Block(torch.nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention (view, transpose, scaled_dot_product_attention),
    LayerNorm, GELU MLP."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_transformer_blocks_keep_batch_and_sequence_symbolic(requires_grad):
    # With inputs requiring grad the recorder writes attention's math (expand, clone, _unsafe_view, bmm, softmax)
    # rather than one node: every view and expand of concrete sizes there is inferred too.
    torch.manual_seed(0)
    blocks, head = torch.nn.Sequential(Block(), Block()), torch.nn.Linear(16, 10)

    def loss(x, target):
        return F.cross_entropy(head(blocks(x)).view(-1, 10), target.view(-1))

    def inputs(b, t):
        return [torch.randn(b, t, 16, requires_grad=requires_grad), torch.randint(0, 10, (b, t))]

    graph, s, failed = symbolic(loss, inputs(4, 6), {0: [0, 1], 1: [0, 1]},
                                others=[inputs(5, 7), inputs(3, 9), inputs(5, 6)])
    assert not s["specialisations"] and failed == [[], [], []]
    assert texts(s) == ["s2*s3 == s0*s1"]  # the target's element count (ties neither dim alone)
    assert "aten::nll_loss_forward" in " ".join(graph.ops())
    assert len(s["int_args"]) > 10 and all("s" in a[3] for a in s["int_args"])


def test_backward_ops_of_a_transformer_block_keep_batch_and_sequence_symbolic():
    # The ATen ops kiln's autodiff emits for the block's backward, called on fakes: views to the forward's sizes,
    # mm, sum, gelu, layer norm, flash attention (CPU) and the loss backward.
    aten = torch.ops.aten

    def backward(x, target, w, g, weight, bias):
        b, t, c = x.shape
        out, mean, rstd = aten.native_layer_norm(x, [c], weight, bias, 1e-5)
        q = out.view(b, t, 2, c // 2).transpose(1, 2)
        attn, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(attn, q, q, q, attn, lse, 0.0, False)
        h = (dq + dk + dv).transpose(1, 2).contiguous().view(b * t, c)
        logits = aten._log_softmax(h @ w.t(), 1, False)
        loss, total = aten.nll_loss_forward(logits, target.view(-1), None, 1, -100)
        d_logits = aten.nll_loss_backward(g, logits, target.view(-1), None, 1, -100, total)
        d_h = aten._log_softmax_backward_data(d_logits, logits, 1, torch.float32) @ w
        d_w = (d_h.t() @ h).sum(0)
        d_x = aten.gelu_backward(d_h.view(b, t, c), x)
        d_ln = aten.native_layer_norm_backward(d_x, x, [c], mean, rstd, weight, bias, [True, True, True])
        return d_ln[0], d_ln[1], d_w, loss

    def inputs(b, t):
        return [torch.randn(b, t, 16), torch.randint(0, 16, (b, t)), torch.randn(16, 16), torch.randn(()),
                torch.randn(16), torch.randn(16)]

    graph, s, failed = symbolic(backward, inputs(4, 6), {0: [0, 1], 1: [0, 1]}, others=[inputs(5, 7), inputs(3, 9)])
    assert not s["specialisations"] and failed == [[], []], str(graph)
    assert "f32[s0, s1, 16], %" in str(graph).split("aten::native_layer_norm_backward")[0].splitlines()[-1]


# ---- the tracer's placeholders ------------------------------------------------------------------------------------
def test_placeholders_resolve_to_the_sizes_they_name():
    def fn(x, w):
        h = x @ w
        return h.view(h.shape[0] // 2, -1)  # the tracer reads h.shape[0] as placeholder p0 and passes p0 // 2

    inputs = randn((8, 4), (4, 6))
    graph = capture(fn, inputs)
    s = graph.propagate_symbolic_sizes({0: [0]}, [(1, 1, 0, "p0 // 2")], [(2, 0), (2, 1)],
                                       [("p0 > 4", "model.py:3"), ("p1 == 6", "model.py:4")])
    assert s["placeholders"] == [{"name": "p0", "value": 2, "dim": 0, "resolved": "s0"},
                                 {"name": "p1", "value": 2, "dim": 1, "resolved": "6"}]  # (a concrete dim)
    assert s["int_args"] == [(1, 1, 0, "floordiv(s0, 2)")] and [x["name"] for x in s["symbols"]] == ["s0"]
    assert texts(s)[0] == "4 < s0" and s["assumptions"][0]["reason"] == "model.py:3"  # ("6 == 6" is dropped)
    assert "# s0: input 0 dim 0, hint 8, range [5, inf)" in str(graph)
    assert "p0" not in str(graph) and "p1" not in graph.to_json()
    for size, guards in ((12, []), (4, ["4 < s0"])):
        got = graph.evaluate_sizes({"s0": size})
        assert got["failed_assumptions"][:len(guards)] == guards
        if not got["failed_assumptions"]:
            assert got["metas"][-1][0] == list(fn(*randn((size, 4), (4, 6))).shape)


def test_trace_assumptions_substitute_and_specialise():
    fn = lambda x, y: (x @ y.t(), x.sum(0))  # noqa: E731
    # `assert h.shape[0] == y.shape[0]`-style equality of a placeholder with another symbol substitutes it.
    graph = capture(fn, randn((4, 8), (6, 8)))
    s = graph.propagate_symbolic_sizes({0: [0], 1: [0]}, [], [(3, 1)], [("p0 == s0 + 2", "model.py:7")])
    assert s["placeholders"][0]["resolved"] == "s0 + 2" and texts(s) == ["s1 == s0 + 2"]
    assert s["values"][3] == ["s0", "s0 + 2"] and not s["specialisations"]
    # An int that escaped to Python pins what it was computed from.
    graph = capture(fn, randn((4, 8), (6, 8)))
    s = graph.propagate_symbolic_sizes({0: [0], 1: [0]}, [], [(3, 0)], [("p0 == 4", "model.py:9: print(n)")])
    assert [(p["symbol"], p["value"]) for p in s["specialisations"]] == [("s0", 4)]
    assert s["specialisations"][0]["reason"] == "model.py:9: print(n) (s0 == 4)"


def test_placeholder_errors_are_user_errors():
    graph = capture(lambda x: x * 2, randn((4, 8)))
    with pytest.raises(Exception, match="has no dim 2"):
        graph.propagate_symbolic_sizes({0: [0]}, [], [(1, 2)])
    with pytest.raises(Exception, match="does not hold at the hints"):
        graph.propagate_symbolic_sizes({0: [0]}, [], [(1, 0)], [("p0 > 4", "model.py:1")])
    with pytest.raises(Exception, match="unknown name|no symbol|p1"):
        graph.propagate_symbolic_sizes({0: [0]}, [], [(1, 0)], [("p1 > 2", "model.py:1")])
    s = graph.propagate_symbolic_sizes({0: [0]}, [], [(1, 0)])  # the failed calls marked nothing
    assert s["placeholders"][0]["resolved"] == "s0"


# ---- guarded or specialised -------------------------------------------------------------------------------------
def test_causal_attention_is_recorded_in_ops_of_concrete_sizes():
    # is_causal makes the recorder write attention's math: a mask made by ones([6, 6]) (sizes no tensor argument
    # explains, so they stay concrete) and expand/view/bmm, whose sizes the graph infers. The batch stays symbolic;
    # adding the mask pins both lengths; bmm's `s0*4 == s2*4` is solved: the key's and value's batch become s0.
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    inputs = randn((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8))
    graph, s, failed = symbolic(fn, inputs, {0: [0, 2], 1: [0, 2], 2: [0, 2]},
                                others=[randn((3, 4, 9, 8), (3, 4, 9, 8), (3, 4, 9, 8)),
                                        randn((3, 4, 6, 8), (3, 4, 6, 8), (3, 4, 6, 8))])
    assert failed[0] and failed[1] == []
    assert {p["symbol"] for p in s["specialisations"]} == {"s1", "s3", "s5"}
    assert s["values"][-1] == ["s0", "4", "6", "8"] and texts(s)[0] == "s0*4 == s2*4"
    assert "f32[s0*4, 6, 8] = aten::bmm.default" in str(graph)


def test_node_without_rule_specialises_with_reason():
    fn = lambda x, y: (x + 1, torch.cummax(y, 1).values * 2)  # noqa: E731
    graph, s, failed = symbolic(fn, randn((4, 6), (3, 5, 8)), {0: [0, 1], 1: [0, 1]},
                                others=[randn((5, 9), (3, 5, 8)), randn((5, 9), (4, 7, 8))])
    assert [(p["symbol"], p["value"], p["reason"]) for p in s["specialisations"]] == [
        ("s2", 3, "node 1 (aten::cummax.default): no rule for aten::cummax.default"),
        ("s3", 5, "node 1 (aten::cummax.default): no rule for aten::cummax.default")]
    assert s["values"][2] == ["s0", "s1"]  # x's values keep their symbols
    assert s["values"][3:] == [["3", "5", "8"], ["3", "5", "8"], ["3", "5", "8"]]  # (cummax's values and indices)
    assert failed == [[], ["s2 == 3", "s3 == 5"]]
    assert "# specialised s2 = 3: node 1 (aten::cummax.default)" in str(graph)


def test_marking_a_missing_dim_is_a_user_error():
    graph = capture(lambda x, y: x * 2 + y, randn((4, 6), (4, 6)))
    with pytest.raises(Exception, match="has no dim 2"):
        graph.propagate_symbolic_sizes({0: [0, 1], 1: [2]})
    retried = graph.propagate_symbolic_sizes({0: [0]})  # the failed call marked nothing
    assert [x["name"] for x in retried["symbols"]] == ["s0"] and texts(retried) == ["s0 == 4"]


def test_graph_without_symbols_prints_and_serialises_as_before():
    graph = capture(lambda x: x.relu(), randn((1, 6)))
    before = (str(graph), graph.to_json())
    summary = graph.propagate_symbolic_sizes({0: [0]})  # a size 1 never becomes a symbol
    assert summary["symbols"] == [] and (str(graph), graph.to_json()) == before
    assert '"symbolic"' not in graph.to_json()


def test_factories_indexing_and_reductions_keep_batch_and_sequence_symbolic():
    # Sizes read from x reach the factories as ints the tracer marks (s0, s1); the rest follows from the inputs.
    def fn(x):
        positions = torch.arange(x.shape[1]).float()
        return (x + positions, torch.zeros(x.shape[0], 3) + x.var(1, keepdim=True), x.max(1).values, x.cumsum(1),
                F.pad(x, (1, 2)), x.topk(2, 1).values, x.masked_fill(x > 0, 0.0), x[:, torch.tensor([0, 1])],
                x.logsumexp(1), x.argmax(-1))

    graph = capture(fn, randn((4, 6)))
    nodes = graph.ops()
    marks = [(nodes.index("aten::arange.default"), 0, -1, "s1"), (nodes.index("aten::zeros.default"), 0, 0, "s0")]
    graph, s, failed = symbolic(fn, randn((4, 6)), {0: [0, 1]}, others=[randn((5, 9)), randn((3, 2))], int_args=marks)
    assert not s["specialisations"] and not s["assumptions"] and failed == [[], []], str(graph)  # (topk: 2 <= s1)
    values = s["values"]
    assert ["s0", "s1"] in values and ["s0", "3"] in values and ["s0", "s1 + 3"] in values and ["s0", "2"] in values
