"""Real models written the way HuggingFace and timm write them, traced whole: one graph, no graph break.

Tiny configurations of bert-base (transformers) and vit_base_patch16_224 (timm), in eval/no_grad and in train
mode (dropout p=0, so gradients of the parameters compare with eager's), each compared with eager and
asserting its number of graphs and breaks. Skipped where transformers or timm are not installed.
"""
import pytest
import torch

import kiln
from kiln.testing import assert_same_as_eager


@pytest.fixture(autouse=True)
def fresh():
    kiln.reset()
    yield
    kiln.reset()


def graphs_and_breaks(model, *args):
    e = kiln.explain(model)(*args)
    kiln.reset()
    return e.graph_count, e.graph_break_count, e.break_reasons


def tiny_bert(dropout):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, vocab_size=100, max_position_embeddings=64,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = transformers.BertModel(config)
    model.config.return_dict = False
    return model


def tiny_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_base_patch16_224", pretrained=False, depth=2, embed_dim=64, num_heads=4,
                             img_size=32, patch_size=8, num_classes=10)


def token_ids(vocab_size=100):
    return torch.randint(0, vocab_size, (2, 16))


def check_whole_graph(model, make_input, grad):
    with torch.set_grad_enabled(grad):
        graphs, breaks, reasons = graphs_and_breaks(model, make_input())
        assert (graphs, breaks) == (1, 0), reasons
        compiled = kiln.compile(model)
        for _ in range(2):
            assert_same_as_eager(model, make_input(), compiled=compiled, grads=grad)
    s = kiln.stats()
    assert (s["frames_compiled"], s["cache_hits"], s["graph_breaks"], s["fallbacks"]) == (1, 1, 0, 0), s
    return compiled


def test_bert_eval_is_one_graph():
    check_whole_graph(tiny_bert(0.1).eval(), token_ids, grad=False)


def test_bert_train_is_one_graph_with_eager_gradients():
    check_whole_graph(tiny_bert(0.0).train(), token_ids, grad=True)


def test_bert_train_with_dropout_is_one_graph():
    model = tiny_bert(0.1).train()
    with torch.enable_grad():
        graphs, breaks, reasons = graphs_and_breaks(model, token_ids())
    assert (graphs, breaks) == (1, 0), reasons


def test_bert_config_change_recompiles():
    # return_dict is read off the config at every call (a guarded constant): flipping it must recompile and
    # give eager's output type, never replay the tuple.
    model = tiny_bert(0.0).eval()
    x = token_ids()
    with torch.no_grad():
        compiled = kiln.compile(model)
        assert isinstance(compiled(x), tuple)
        model.config.return_dict = True
        out = compiled(x)
        assert type(out) is type(model(x)) and not isinstance(out, tuple)
        torch.testing.assert_close(out.last_hidden_state, model(x).last_hidden_state)
    s = kiln.stats()
    assert (s["frames_compiled"], s["recompiles"], s["graph_breaks"]) == (2, 1, 0), s


def test_vit_eval_is_one_graph():
    check_whole_graph(tiny_vit().eval(), lambda: torch.randn(2, 3, 32, 32), grad=False)


def test_vit_train_is_one_graph_with_eager_gradients():
    check_whole_graph(tiny_vit().train(), lambda: torch.randn(2, 3, 32, 32), grad=True)
