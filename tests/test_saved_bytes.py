"""What a Linear keeps for backward, counted against its plan's TensorProtos.

Every tensor saved for backward (torch.autograd.graph.saved_tensors_hooks) is counted once per
storage; parameters are left out (saving one costs nothing). A layer must save exactly what its
`LinearPlan` describes: the columnwise input (`saved_protos`), the raw input where the plan says
so, and delayed scaling's scale snapshots. An eager call saves the weight dgrad reads from forward's
quantize (`keep_quantized_weight`, as TE; compiled graphs quantize it again in backward), and
Linears reading one tensor save their input's quantized copy once.
"""
import dataclasses
import os
import sys

import pytest
import torch
from linear_cases import QUANTIZED_IDS, RECIPE_IDS, RECIPES, recipe_ctx

import transformer_engine_proto as te
from transformer_engine_proto.custom_ops import linear as L
from transformer_engine_proto.custom_ops import linear_plan, shared_input
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import saved_tensors  # noqa: E402

TOKENS, IN, OUT = 96, 64, 128
STATELESS = [r for r in QUANTIZED_IDS if r != "delayed"]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _proto_bytes(proto) -> int:
    return sum(_bytes(b) for b in dataclasses.replace(proto, device="meta").create_buffers().values())


def saved_storages(fn, params=()):
    """{storage data_ptr: (nbytes, dtype, shape)} of the tensors saved while `fn()` runs (parameters left out)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


def plan_bytes(rid, m, x, save_original_input=False):
    """What the plan says a call saves: protos, raw input, delayed-scaling scale snapshots."""
    key = RecipeKey.of(RECIPES[rid])
    bias_rg = m.bias is not None and m.bias.requires_grad
    plan = linear_plan.make_plan(key, tuple(x.shape), tuple(m.weight.shape), x.dtype, m.weight.dtype,
                       L.LinearCall(x.requires_grad, m.weight.requires_grad, bias_rg, save_original_input,
                                    keep_quantized_weight=True), False)
    n = sum(_proto_bytes(p) for p in plan.saved_protos)
    if plan.saves_raw_input():
        n += _bytes(x)
    if plan.quantized and plan.delayed:
        n += _bytes(m.gemm.delayed_state[:3])  # the snapshot of the scales (input, weight, gradient)
    return n, plan


@pytest.mark.parametrize("save_original_input", [False, True])
@pytest.mark.parametrize("input_rg,weight_rg", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_linear_saves_what_its_plan_says(rid, input_rg, weight_rg, save_original_input):
    torch.manual_seed(0)
    m = te.Linear(IN, OUT, bias=False, save_original_input=save_original_input)
    m.weight.requires_grad_(weight_rg)
    x = torch.randn(TOKENS, IN, requires_grad=input_rg)
    with recipe_ctx(RECIPES[rid]):
        seen, y = saved_storages(lambda: m(x), m.parameters())
    expected, plan = plan_bytes(rid, m, x, save_original_input)
    got = sum(n for n, *_ in seen.values())
    assert got == expected, (rid, got, expected, sorted(seen.values(), key=str))
    # eager keeps the weight exactly where dgrad reads a quantized one
    assert (plan.saved_weight is not None) == (plan.quantized and plan.fprop_q and (plan.dgrad_q or plan.dgrad_deq))
    y.sum().backward()


def _qkv(rid, share=True, seed=0):
    """Three Linears reading one (non-leaf) tensor, as HF Llama's q/k/v; `share=False` feeds each
    its own copy of the input (the reference: nothing to share)."""
    torch.manual_seed(seed)
    lin = [te.Linear(IN, OUT, bias=False) for _ in range(3)]
    h = torch.randn(TOKENS, IN, requires_grad=True)
    gs = [torch.randn(TOKENS, OUT) for _ in range(3)]  # the grad_outputs (constants: not counted)

    def fwd():
        x = h * 2.0
        xs = [x] * 3 if share else [x.clone() for _ in range(3)]
        return sum((m(xi) * g).sum() for m, xi, g in zip(lin, xs, gs))

    return lin, h, fwd, gs


def _state(modules):
    """Each module's buffers (the delayed-scaling state), copied, in name order."""
    return [[b.clone() for _, b in sorted(m.named_buffers())] for m in modules]


def _assert_same_state(rid, state, ref_modules):
    for bs, r in zip(state, ref_modules):
        for b, (name, rb) in zip(bs, sorted(r.named_buffers())):
            assert torch.equal(b, rb), (rid, name)


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_shared_input_saved_once_and_bitwise(rid):
    lin, h, fwd, gs = _qkv(rid)
    params = [p for m in lin for p in m.parameters()] + gs
    with recipe_ctx(RECIPES[rid]):
        seen, loss = saved_storages(fwd, params)
    loss.backward()
    got = sum(n for n, *_ in seen.values())
    x = torch.empty(TOKENS, IN)
    one, plan = plan_bytes(rid, lin[0], x.requires_grad_())
    inp = _proto_bytes(plan.saved_input)
    # `h * 2.0` saves nothing (a Python scalar); the grad_outputs `gs` are left out
    assert got == 3 * (one - inp) + inp, (rid, got, one, inp, sorted(seen.values(), key=str))
    grads = [h.grad] + [m.weight.grad for m in lin]
    state = _state(lin)

    ref_lin, ref_h, ref_fwd, _ = _qkv(rid, share=False)
    with recipe_ctx(RECIPES[rid]):
        ref_loss = ref_fwd()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, [ref_h.grad] + [m.weight.grad for m in ref_lin]):
        assert torch.equal(g, r)
    _assert_same_state(rid, state, ref_lin)  # delayed: every reader recorded the input's amax


def test_shared_input_not_reused_after_in_place_write_or_autocast_exit():
    recipe = RECIPES["current"]
    torch.manual_seed(0)
    a, b = te.Linear(IN, OUT), te.Linear(IN, OUT)
    x = torch.randn(TOKENS, IN, requires_grad=True) * 1.0
    with recipe_ctx(recipe):
        a(x)
        hits = shared_input.stats["hits"]
        with torch.no_grad():
            x.mul_(3.0)  # bumps the version counter: the entry is stale
        y = b(x)
        assert shared_input.stats["hits"] == hits
    with recipe_ctx(recipe):
        ref = b(x.detach().clone().requires_grad_())
    assert torch.equal(y, ref)
    with recipe_ctx(recipe):
        a(x)
    assert not shared_input._local.entries  # autocast exit dropped them


def test_shared_input_entry_dies_with_its_tensor():
    with recipe_ctx(RECIPES["current"]):
        m = te.Linear(IN, OUT)
        x = torch.randn(TOKENS, IN) * 1.0
        m(x)
        assert shared_input._local.entries
        del x
        assert not shared_input._local.entries


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_weight_requantized_in_backward_is_bitwise_the_forward_one(rid):
    """Backward quantizes the columnwise weight alone; a quantize of both usages (what forward
    used to save) gives the same bytes."""
    key = RecipeKey.of(RECIPES[rid])
    q = RecipeKey.quantizers(key).weight
    torch.manual_seed(0)
    w = torch.randn(OUT, IN, dtype=torch.bfloat16)
    if rid == "delayed":
        q = q.with_scale_state(torch.tensor([3.5]), torch.zeros(1))
    both = q.with_usage(rowwise=True, columnwise=True).quantize(w, internal=True).only_usage(False)
    col = q.with_usage(rowwise=False, columnwise=True).quantize(w, internal=True)
    a, b = both.get_buffers(), col.get_buffers()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]), (rid, k)


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_compiled_qkv_saves_quantized_input_once(rid):
    """Under inductor (the ops inlined), the q/k/v Linears' quantizes of one input are one: the
    backward graph gets one quantized input, not three (AOT's CSE does not merge Triton quantize
    launches on the GPU; the shared quantize does not depend on it); delayed scaling's state
    after the step is the unshared eager run's."""
    lin, h, fwd, _ = _qkv(rid)
    hits = shared_input.stats["hits"]

    def step(backend):
        with recipe_ctx(RECIPES[rid]):
            loss = torch.compile(fwd, backend=backend)()
        loss.backward()

    saved = [v for n, v in saved_tensors.compiled_backward_inputs(step) if not n.startswith("primals")]
    assert shared_input.stats["hits"] - hits == 2
    acts = [t for t in saved if t.dtype == torch.float8_e4m3fn and TOKENS in t.shape]
    assert len(acts) == 1, [(t.shape, t.dtype) for t in saved]
    state = _state(lin)
    ref_lin, _, ref_fwd, _ = _qkv(rid, share=False)
    with recipe_ctx(RECIPES[rid]):
        ref_fwd().backward()
    _assert_same_state(rid, state, ref_lin)


class _TorchRMSNorm(torch.nn.Module):
    """An RMSNorm in torch ops, as Hugging Face's: inductor sees through it."""

    def __init__(self, n, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device=device))

    def forward(self, h):
        x = h.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _norm_linear_compiled(rid, recompute, device="cpu", graphs=None, shape=(TOKENS, IN, OUT), torch_norm=False):
    """A norm -> Linear step under inductor (fresh modules; `shape`: tokens, in, out; te.RMSNorm or
    `_TorchRMSNorm`): (saved (TOKENS, IN)-sized activations, the grads of the input, the norm weight
    and the Linear weight)."""
    tokens, n_in, n_out = shape
    from transformer_engine_proto.custom_ops import recompute_tags

    torch.manual_seed(0)  # fresh modules: delayed scaling's state starts equal
    norm = (_TorchRMSNorm(n_in, device) if torch_norm
            else te.RMSNorm(n_in, params_dtype=torch.bfloat16, device=device))
    lin = te.Linear(n_in, n_out, bias=False, params_dtype=torch.bfloat16, device=device)
    h = torch.randn(tokens, n_in, dtype=torch.bfloat16, device=device, requires_grad=True)
    recompute_tags.set_recompute_saved_input(recompute)
    grads = []

    def step(backend):
        for t in (h, norm.weight, lin.weight):
            t.grad = None
        with recipe_ctx(RECIPES[rid]):
            loss = torch.compile(lambda: lin(norm(h)).float().square().sum(), backend=backend)()
        loss.backward()
        grads.extend(t.grad for t in (h, norm.weight, lin.weight))

    try:
        saved = [v for n, v in saved_tensors.compiled_backward_inputs(step, graphs)
                 if not n.startswith("primals")]
    finally:
        recompute_tags.set_recompute_saved_input(None)
    return [tuple(t.shape) for t in saved if sorted(t.shape) == sorted((TOKENS, IN))], grads


@pytest.mark.parametrize("rid", ["current", "delayed"])  # on CPU, compiled MXFP8 recomputes its quantizes anyway
def test_recompute_saved_input_saves_no_quantized_activation(rid):
    """set_recompute_saved_input(True): under inductor a norm -> Linear saves neither the FP8 input
    nor the norm's output (both rebuilt in backward from the norm's input), with the same grads."""
    acts_saved, grads_saved = _norm_linear_compiled(rid, False)
    acts_rebuilt, grads_rebuilt = _norm_linear_compiled(rid, True)
    assert acts_saved and not acts_rebuilt, (acts_saved, acts_rebuilt)
    for a, b in zip(grads_saved, grads_rebuilt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_recompute_saved_input_recomputes_a_torch_norm(rid, device):
    """An input made by torch ops (Hugging Face's RMSNorm) is recomputed for backward's cast, not
    saved in bf16: AOT's partitioner never recomputes a tensor that a Triton kernel of backward
    reads, so the cast reads it through a fusible op (`recompute_tags.recomputable_read`)."""
    acts_saved, grads_saved = _norm_linear_compiled(rid, False, device, torch_norm=True)
    acts_rebuilt, grads_rebuilt = _norm_linear_compiled(rid, True, device, torch_norm=True)
    assert acts_saved and not acts_rebuilt, (acts_saved, acts_rebuilt)
    # inductor recomputes the torch norm in a kernel of its own, whose reduction order may differ
    # from the forward's (an ulp of the input can move an FP8 code): close, not bitwise
    for a, b in zip(grads_saved, grads_rebuilt):
        torch.testing.assert_close(b, a, rtol=0.05, atol=1e-3)


def _shape(node):
    return tuple(getattr(getattr(node, "meta", {}).get("val"), "shape", ()))


def _fp8_buffers(graph, shape):
    """The `empty` FP8 buffers of `shape` a graph allocates (a quantize's outputs, either kernel)."""
    return [n for n in graph.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.empty.memory_format
            and _shape(n) == shape and n.meta["val"].dtype == torch.float8_e4m3fn]


def _amax_passes(graph, shape):
    """The amax reductions over a tensor of `shape`: aten's (reference kernels) or a Triton amax kernel's."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    out = []
    for n in graph.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target == torch.ops.aten.amax.default and _shape(n.args[0]) == shape:
            out.append(n.name)
        elif "triton_kernel_wrapper" in str(n.target):
            fn = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            name = getattr(getattr(fn, "fn", fn), "__name__", str(fn))
            if "amax" in name and any(_shape(v) == shape for v in n.kwargs["kwargs"].values()):
                out.append(name)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_recompute_saved_input_rebuilds_only_the_columnwise_bytes(rid, device):
    """With the input rebuilt in backward, the forward allocates no columnwise FP8 input (IN, TOKENS):
    it writes only the rowwise bytes fprop reads; backward casts the columnwise copy with the
    forward's scale, so it takes no amax of the input (current scaling saves the amax instead)."""
    graphs = []
    _norm_linear_compiled(rid, True, device, graphs)
    (fw, bw), = graphs
    assert not _fp8_buffers(fw, (IN, TOKENS))
    assert _fp8_buffers(bw, (IN, TOKENS))
    assert not _amax_passes(bw, (TOKENS, IN)), _amax_passes(bw, (TOKENS, IN))


def _triton_kernels_reading(graph, shape):
    """The names of the user Triton kernels a graph launches with an argument of `shape`."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    out = []
    for n in graph.graph.nodes:
        if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target):
            fn = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            if any(_shape(v) == shape for v in n.kwargs["kwargs"].values()):
                out.append(getattr(getattr(fn, "fn", fn), "__name__", str(fn)))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_recompute_saved_input_casts_in_the_recomputing_kernel_cuda(rid):
    """Per-tensor FP8: backward's columnwise cast of the rebuilt input is traced as its aten
    reference (`kernels.fused_into_producer`), so inductor writes the FP8 bytes from the kernel
    that recomputes the input; no Triton kernel of backward reads the (TOKENS, IN) input or
    writes its (IN, TOKENS) copy, which forward still casts with our kernel."""
    graphs = []
    _norm_linear_compiled(rid, True, "cuda", graphs, torch_norm=True)
    (fw, bw), = graphs
    assert _fp8_buffers(bw, (IN, TOKENS))
    in_backward = _triton_kernels_reading(bw, (TOKENS, IN)) + _triton_kernels_reading(bw, (IN, TOKENS))
    assert not in_backward, in_backward
    in_forward = _triton_kernels_reading(fw, (TOKENS, IN))
    assert any("cast" in name for name in in_forward), in_forward


@pytest.mark.cuda
@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_recompute_saved_input_same_grads_cuda(rid):
    """The Triton kernels: rebuilding the input in backward (each format's usages quantized apart)
    gives the gradients of saving it, bit for bit (shapes every native GEMM takes)."""
    _, grads_saved = _norm_linear_compiled(rid, False, "cuda", shape=(256, 256, 256))
    _, grads_rebuilt = _norm_linear_compiled(rid, True, "cuda", shape=(256, 256, 256))
    for a, b in zip(grads_saved, grads_rebuilt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_kept_weight_gives_the_requantized_bytes(rid, monkeypatch):
    """Eager keeps forward's quantized weight; without it (as compiled graphs run) backward
    quantizes the weight again: the same bytes, so the same gradients bit for bit."""
    def run(keep: bool):
        torch.manual_seed(0)
        m = te.Linear(IN, OUT)
        x = torch.randn(TOKENS, IN, requires_grad=True)
        with monkeypatch.context() as mp:
            if not keep:  # the flag `linear` sets under torch.compile
                mp.setattr(torch.compiler, "is_compiling", lambda: True)
            with recipe_ctx(RECIPES[rid]):
                seen, y = saved_storages(lambda: m(x), m.parameters())
        y.backward(torch.randn_like(y))
        return seen, y, x.grad, m.weight.grad
    seen_keep, *kept = run(True)
    seen_again, *again = run(False)
    for a, b in zip(kept, again):
        assert torch.equal(a, b)
    m = te.Linear(IN, OUT)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    _, plan = plan_bytes(rid, m, x)
    again = linear_plan.make_plan(plan.key, plan.in_shape, plan.weight_shape, plan.act_dtype, plan.weight_dtype,
                                  dataclasses.replace(plan.call, keep_quantized_weight=False), False)
    extra = sum(n for n, *_ in seen_keep.values()) - sum(n for n, *_ in seen_again.values())
    amax_bytes = 4 if again.reuses_weight_amax else 0  # the forward's weight amax, which backward quantizes with
    assert again.reuses_weight_amax == (rid == "current")
    assert plan.saved_weight is not None and extra == _proto_bytes(plan.saved_weight) - amax_bytes
