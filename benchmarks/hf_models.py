"""transformers models as their users call them, eager vs torch.compile vs kiln, side by side in one process.

    python3 benchmarks/hf_models.py [--systems eager,inductor,kiln] [--models bert,gpt2,llama] [--sizes tiny,base]
                                    [--modes eval,train] [--device cuda] [--iters 20]

Each model has a task head and is called with an attention mask (the second row padded) and labels, so that it
computes its loss. Sizes: `tiny` (2 layers, hidden 64, as tests/python/test_hf_architectures.py) and `base`
(BERT-base, GPT-2 small, Llama with 8 layers of 1024), random weights, batch 8 x 128 tokens. `train` is one step
of AdamW on the model's loss. One JSON line per row (ms per call or step, the first call's seconds, graphs and
breaks of one call for kiln), then a table with each system's ms and kiln against the faster of the others.
"""
import argparse
import json
import sys
import time

import torch


def build(arch, size):
    import transformers as T

    torch.manual_seed(0)
    tiny = size == "tiny"
    if arch == "bert":
        config = T.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              vocab_size=1000) if tiny else T.BertConfig()
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        return T.BertForMaskedLM(config)
    if arch == "gpt2":
        config = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000) if tiny else T.GPT2Config()
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        return T.GPT2LMHeadModel(config)
    if arch == "llama":
        config = T.LlamaConfig(num_hidden_layers=2 if tiny else 8, hidden_size=64 if tiny else 1024,
                               intermediate_size=128 if tiny else 2816, num_attention_heads=4 if tiny else 16,
                               num_key_value_heads=2 if tiny else 8, vocab_size=1000 if tiny else 32000)
        return T.LlamaForCausalLM(config)
    raise ValueError(f"unknown model {arch!r}")


def inputs(model, device, batch=8, length=128):
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[1, length * 3 // 4:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids)


def compiled(system, model):
    if system == "eager":
        return model
    if system == "inductor":
        return torch.compile(model)
    if system == "kiln":
        import kiln
        return kiln.compile(model)
    raise ValueError(f"unknown system {system!r}")


def measure(system, arch, size, mode, device, iters):
    model = build(arch, size).to(device).train(mode == "train")
    run = compiled(system, model)
    kw = inputs(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if mode == "train" else None

    def step():
        if optimizer is None:
            with torch.no_grad():
                return run(**kw).loss
        optimizer.zero_grad(set_to_none=True)
        loss = run(**kw).loss
        loss.backward()
        optimizer.step()
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = time.perf_counter()
    loss = step()
    sync()
    first = time.perf_counter() - started
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    row = dict(model=arch, size=size, mode=mode, system=system, device=device, first_call_s=round(first, 3),
               ms=round(sorted(times)[len(times) // 2], 4), loss=round(float(loss), 6))
    if system == "kiln":
        import kiln
        kiln.reset()
        with torch.set_grad_enabled(mode == "train"):
            explained = kiln.explain(model)(**kw)
        row.update(graphs=explained.graph_count, breaks=explained.graph_break_count)
        kiln.reset()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="eager,inductor,kiln")
    ap.add_argument("--models", default="bert,gpt2,llama")
    ap.add_argument("--sizes", default="tiny,base")
    ap.add_argument("--modes", default="eval,train")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        for arch in args.models.split(","):
            for mode in args.modes.split(","):
                for system in args.systems.split(","):
                    try:
                        row = measure(system, arch, size, mode, args.device, args.iters)
                    except Exception as e:  # one failing row must not hide the others
                        row = dict(model=arch, size=size, mode=mode, system=system, error=repr(e)[:300])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    systems = args.systems.split(",")
    print("| model | size | mode | " + " | ".join(f"{s} ms" for s in systems) + " | kiln vs the faster | kiln graphs |")
    print("|---" * (len(systems) + 5) + "|")
    keys = sorted({(r["model"], r["size"], r["mode"]) for r in rows}, key=lambda k: (k[1], k[0], k[2]))
    for key in keys:
        by = {r["system"]: r for r in rows if (r["model"], r["size"], r["mode"]) == key}
        cells = [str(by.get(s, {}).get("ms", "error")) for s in systems]
        others = [by[s]["ms"] for s in systems if s != "kiln" and "ms" in by.get(s, {})]
        kiln_row = by.get("kiln", {})
        ratio = f"{min(others) / kiln_row['ms']:.3f}x" if others and "ms" in kiln_row else "-"
        print(f"| {' | '.join(key)} | {' | '.join(cells)} | {ratio} | {kiln_row.get('graphs', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
