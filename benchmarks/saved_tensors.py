"""What backward keeps alive: the tensors saved for backward, by module and kind, eager and compiled.

    python benchmarks/saved_tensors.py                       # tiny HF Llama decoder layer, every recipe
    python benchmarks/saved_tensors.py --compile             # also what the compiled graph saves
    python benchmarks/saved_tensors.py --recipes current --tokens 256 --hidden 256

Eager: one forward of a `LlamaForCausalLM` (random init, `te.convert_model`, bf16) under
`torch.autograd.graph.saved_tensors_hooks`: every packed tensor is attributed to the innermost
module running, deduplicated by storage (`untyped_storage().data_ptr()`); parameters are listed
apart (saving one costs nothing). Compiled: the model under inductor (our ops inlined) with
`compile_fx`'s partitioner wrapped: the backward graph's non-tangent inputs are what the compiled
forward saves (`primals_*` are the model's own inputs / parameters). No inductor codegen runs
(the inner compile is replaced by running the graph), so this is quick on CPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402

RECIPES = ["bf16", "current", "delayed", "blockwise", "mxfp8", "nvfp4"]


def build(args, recipe_name):
    from transformers import LlamaConfig, LlamaForCausalLM

    import transformer_engine_proto as te

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=args.device, dtype=torch.bfloat16)
    recipe = C.make_recipe(recipe_name)
    if recipe is not None:
        model = te.convert_model(model, recipe=recipe)
    return model, recipe


_TOKENS = [0]  # the token count: a quantized buffer with a dim near it is an activation (a shape
# heuristic: NVFP4's packed halves read as weights; compare totals there)


def _kind(t: torch.Tensor) -> str:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.float8_e8m0fnu):
        m = _TOKENS[0]
        act = any(m > 0 and m <= d * r < m + 128 for d in t.shape for r in (1, 16, 32, 128))
        return "q-act" if act else "q-weight"
    return str(t.dtype).replace("torch.", "")


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def eager_saved(model, recipe, ids):
    """{module name: {kind: bytes}} of the storages saved for backward in one forward (each storage
    counted once, under the first module that saved it), and the parameters' bytes apart."""
    import transformer_engine_proto as te

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen = [], {}
    names = {m: n or "<model>" for n, m in model.named_modules()}
    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(lambda mod, _a: stack.append(names[mod]) and None))
        handles.append(m.register_forward_hook(lambda mod, _a, _o: stack.pop() and None))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            where = "<parameter>" if ptr in params else (stack[-1] if stack else "<top>")
            seen[ptr] = (where, _kind(t), _nbytes(t), tuple(t.shape))
        return t

    ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            loss = model(ids, labels=ids).loss
    finally:
        for h in handles:
            h.remove()
    loss.backward()
    return seen


def compiled_backward_inputs(fn, graphs=None):
    """Run `fn()` (compiled: `fn` takes the backend) and return the fake values of the backward
    graphs' non-tangent inputs, by name: what the compiled forward saves. Inductor's own
    decompositions, joint passes and partitioner run; its codegen does not (the graphs run as
    they are), so this is quick on CPU. `graphs`: a list to append each (forward, backward) to."""
    import torch._inductor.compile_fx as cfx

    saved = []
    real = cfx.min_cut_rematerialization_partition

    def partition(*a, **k):
        fw, bw = real(*a, **k)
        if graphs is not None:
            graphs.append((fw, bw))
        saved.extend((n.name, n.meta["val"]) for n in bw.graph.find_nodes(op="placeholder")
                     if not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor))
        return fw, bw

    def inner(gm, example_inputs, **kwargs):
        def run(args):
            out = gm(*args)
            args.clear()
            return out

        run._boxed_call = True
        return run

    torch._dynamo.reset()
    cfx.min_cut_rematerialization_partition = partition
    try:
        fn(lambda gm, inputs: cfx.compile_fx(gm, inputs, inner_compile=inner))
    finally:
        cfx.min_cut_rematerialization_partition = real
        torch._dynamo.reset()
    return saved


def compiled_saved(model, recipe, ids):
    """[(name, kind, bytes, shape)] of what the compiled forward saves (`primals_*`: inputs)."""
    import transformer_engine_proto as te

    def step(backend):
        ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            loss = torch.compile(model, backend=backend)(ids, labels=ids).loss
        loss.backward()

    return [(n, _kind(v), _nbytes(v) if v.numel() else 0, tuple(v.shape)) for n, v in compiled_backward_inputs(step)]


def _fmt(n):
    return f"{n / 2**20:8.2f} MiB"


def summarize_eager(seen, layer_prefix):
    by_module = defaultdict(lambda: defaultdict(int))
    for where, kind, nbytes, _ in seen.values():
        by_module[where][kind] += nbytes
    total = defaultdict(int)
    layer = defaultdict(int)
    for where, kinds in by_module.items():
        if where == "<parameter>":
            continue
        for k, b in kinds.items():
            total[k] += b
            if where.startswith(layer_prefix):
                layer[k] += b
    return by_module, dict(total), dict(layer)


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--recipes", nargs="*", default=RECIPES)
    C.add_model_args(p, hidden=256, ffn=704, heads=4, layers=1, vocab=512, seq=1024, batch=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="also what the compiled graph saves")
    p.add_argument("--modules", action="store_true", help="eager: per module breakdown")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    _TOKENS[0] = args.batch * args.seq
    layer_prefix = "model.layers.0"
    print(f"Llama hidden {args.hidden}, ffn {args.ffn}, {args.layers} layer(s), {args.batch}x{args.seq} tokens, "
          f"vocab {args.vocab}, bf16; saved-for-backward bytes, parameters excluded")
    for name in args.recipes:
        model, recipe = build(args, name)
        seen = eager_saved(model, recipe, ids)
        by_module, total, layer = summarize_eager(seen, layer_prefix)
        tot = sum(total.values())
        lay = sum(layer.values())
        print(f"\n[{name}] eager: total {_fmt(tot)} {total}; layer 0 {_fmt(lay)} {layer}")
        if args.modules:
            for where in sorted(by_module):
                print(f"    {where:40s} {dict(by_module[where])}")
            if args.modules:
                for _ptr, (where, kind, nbytes, shape) in seen.items():
                    if where.startswith(layer_prefix):
                        print(f"      {where:40s} {kind:10s} {nbytes:10d} {shape}")
        if args.compile:
            model, recipe = build(args, name)
            saved = compiled_saved(model, recipe, ids)
            comp = defaultdict(int)
            for n, kind, nbytes, _shape in saved:
                if not n.startswith("primals"):
                    comp[kind] += nbytes
            print(f"[{name}] compiled: {_fmt(sum(comp.values()))} {dict(comp)} "
                  f"({len(saved)} saved, {sum(n.startswith('primals') for n, *_ in saved)} of them primals)")
            if args.modules:
                for n, kind, nbytes, shape in saved:
                    if not n.startswith("primals") and nbytes:
                        print(f"      {n:40s} {kind:10s} {nbytes:10d} {shape}")


if __name__ == "__main__":
    main()
