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
    fn = lambda x, y: (x + 1, torch.cumsum(y, 1) * 2)  # noqa: E731
    graph, s, failed = symbolic(fn, randn((4, 6), (3, 5, 8)), {0: [0, 1], 1: [0, 1]},
                                others=[randn((5, 9), (3, 5, 8)), randn((5, 9), (4, 7, 8))])
    assert [(p["symbol"], p["value"], p["reason"]) for p in s["specialisations"]] == [
        ("s2", 3, "node 1 (aten::cumsum.default): no rule for aten::cumsum.default"),
        ("s3", 5, "node 1 (aten::cumsum.default): no rule for aten::cumsum.default")]
    assert s["values"][2] == ["s0", "s1"]  # x's values keep their symbols
    assert s["values"][3:] == [["3", "5", "8"], ["3", "5", "8"]]
    assert failed == [[], ["s2 == 3", "s3 == 5"]]
    assert "# specialised s2 = 3: node 1 (aten::cumsum.default)" in str(graph)


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
