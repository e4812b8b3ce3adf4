"""`torch.library.opcheck` on te_proto::linear_fwd (and through it the registered autograd) and
te_proto::linear_bwd, for every recipe, bias on/off, every requires-grad combination and the
three weight-cache modes.

opcheck's harness assumes any floating tensor supports `sum` and `allclose`; on CPU, torch has
neither for the 1-byte float dtypes (float8_e4m3fn / e5m2 / e8m0fnu) that our ops return as the
flattened saved/cached buffers. Without help, `test_schema` fails inside SchemaCheckMode with
`"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'` (its `bitwise_equal` calls
`torch.allclose` on every fp8 tensor argument of every aten op the real impl runs), and
`test_aot_dispatch_dynamic` fails with `"sum_cpu" not implemented for 'Float8_e4m3fn'` (it sums
every output to build a loss). These are gaps of torch's test harness, not of our ops, so the
`fp8_harness` fixture makes exactly those two calls bitwise on the raw bytes of 1-byte floats
(which is what "equal" means for quantized buffers) and leaves every other dtype alone.
"""
import dataclasses
import itertools

import pytest
import torch
from linear_cases import QUANTIZED_IDS, RECIPE_IDS, RECIPES

from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import linear_ops as L
from transformer_engine_proto.custom_ops import linear_plan
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

IN, OUT, TOKENS = 64, 32, 32  # divisible by every block: MXFP8 32, NVFP4 16 (1D and 2D)
H = 16  # delayed-scaling history rows given to the ops


def _low_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1


@pytest.fixture
def fp8_harness(monkeypatch):
    """Bitwise `allclose` / byte `sum` for 1-byte floats, only while opcheck runs (see module doc)."""
    orig_allclose, orig_sum = torch.allclose, torch.Tensor.sum

    def allclose(a, b, *args, **kwargs):
        if _low_float(a) or _low_float(b):
            return (a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
        return orig_allclose(a, b, *args, **kwargs)

    def tensor_sum(self, *args, **kwargs):
        if _low_float(self):
            return orig_sum(self.view(torch.uint8), *args, **kwargs)
        return orig_sum(self, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)
    monkeypatch.setattr(torch.Tensor, "sum", tensor_sum)


def _opcheck(op, args):
    torch.library.opcheck(op, args, raise_exception=True)


def _delayed_state(recipe):
    if not isinstance(recipe, R.DelayedScaling):
        return None, []
    # non-trivial scales (input, weight, gradient) so a wrong slot or a missing bind shows up as different
    # numbers; the handoff: [pending amax, its generation, the generation folded]
    return torch.tensor([96.0, 12.0, 2048.0]), [torch.tensor([3.0, 1.0, 1.0])]


def _cache_buffers(recipe, plan, weight, fp8_scale):
    """The weight cache the module would hold: the plan's cached_weight proto, filled by
    quantizing the weight (checked against the proto's layout: the central invariant)."""
    proto = plan.cached_weight
    if proto is None:
        return []
    q = proto.quantizer
    if isinstance(recipe, R.DelayedScaling):
        q = dataclasses.replace(q, scale=fp8_scale[1:2].clone(), amax=torch.zeros(1))
    real = q.quantize(weight.detach()).get_buffers()
    fake = proto.create_buffers()
    assert list(real) == list(fake)
    for name in real:
        assert (real[name].shape, real[name].stride(), real[name].dtype) == \
               (fake[name].shape, fake[name].stride(), fake[name].dtype), name
    return [b.clone() for b in real.values()]


def fwd_args(recipe, *, bias, input_rg, weight_rg, cache_mode=L.CACHE_OFF, save_original_input=False,
             fuse_wgrad_accumulation=False, dtype=torch.float32, seed=0):
    """The exact positional argument list of te_proto::linear_fwd, built as `linear()` does."""
    g = torch.Generator().manual_seed(seed)
    key = RecipeKey.of(recipe)
    x = torch.randn(TOKENS, IN, generator=g, dtype=dtype).requires_grad_(input_rg)
    w = (torch.randn(OUT, IN, generator=g, dtype=dtype) * 0.1).requires_grad_(weight_rg)
    b = torch.randn(OUT, generator=g, dtype=dtype).requires_grad_() if bias else None
    fp8_scale, grad_amax_state = _delayed_state(recipe)
    fuse = fuse_wgrad_accumulation and weight_rg
    call = L.LinearCall(input_rg, weight_rg, bias, save_original_input, fuse, cache_mode)
    plan = linear_plan.plan_of(key, x, w, call)
    cache = _cache_buffers(recipe, plan, w, fp8_scale) if recipe is not None else []
    main_grad = torch.zeros(OUT, IN, dtype=torch.float32) if fuse else None
    return (x, w, b, fp8_scale, grad_amax_state, cache, main_grad, key, call.flags, [])


GRAD_COMBOS = list(itertools.product([False, True], repeat=3))  # (bias, input_rg, weight_rg)
CACHED_COMBOS = [(True, True, True), (False, True, False), (False, False, True), (True, False, False)]


def _fwd_cases():
    cases = []
    for rid in RECIPE_IDS:
        for bias, irg, wrg in GRAD_COMBOS:
            cases.append(pytest.param(rid, L.CACHE_OFF, bias, irg, wrg,
                                      id=f"{rid}-off-bias{int(bias)}-x{int(irg)}-w{int(wrg)}"))
        if RECIPES[rid] is None:
            continue  # high precision never uses the weight cache
        for mode, mname in ((L.CACHE_FILL, "fill"), (L.CACHE_USE, "use")):
            for bias, irg, wrg in CACHED_COMBOS:
                cases.append(pytest.param(rid, mode, bias, irg, wrg,
                                          id=f"{rid}-{mname}-bias{int(bias)}-x{int(irg)}-w{int(wrg)}"))
    return cases


@pytest.mark.parametrize("rid,cache_mode,bias,input_rg,weight_rg", _fwd_cases())
def test_opcheck_linear_fwd(fp8_harness, rid, cache_mode, bias, input_rg, weight_rg):
    args = fwd_args(RECIPES[rid], bias=bias, input_rg=input_rg, weight_rg=weight_rg, cache_mode=cache_mode)
    _opcheck(torch.ops.te_proto.linear_fwd.default, args)


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_opcheck_linear_fwd_save_original_input(fp8_harness, rid):
    args = fwd_args(RECIPES[rid], bias=True, input_rg=True, weight_rg=True, save_original_input=True)
    _opcheck(torch.ops.te_proto.linear_fwd.default, args)


@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_opcheck_linear_fwd_fuse_wgrad_accumulation(fp8_harness, rid):
    args = fwd_args(RECIPES[rid], bias=False, input_rg=True, weight_rg=True, fuse_wgrad_accumulation=True)
    _opcheck(torch.ops.te_proto.linear_fwd.default, args)


@pytest.mark.parametrize("rid", ["delayed", "mxfp8"])
def test_opcheck_linear_fwd_bfloat16(fp8_harness, rid):
    args = fwd_args(RECIPES[rid], bias=True, input_rg=True, weight_rg=True, dtype=torch.bfloat16)
    _opcheck(torch.ops.te_proto.linear_fwd.default, args)


def test_fake_outputs_match_real_save_original_input():
    """The invariant itself, without opcheck, for the save_original_input plans (opcheck covers
    the others above): the fake impl's saved/cache lists have the real impl's shapes, strides and
    dtypes for every recipe, requires-grad combination and cache mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    soi = True
    for rid in QUANTIZED_IDS:
        for (bias, irg, wrg), mode in itertools.product(GRAD_COMBOS, (0, 1, 2)):
            args = fwd_args(RECIPES[rid], bias=bias, input_rg=irg, weight_rg=wrg, cache_mode=mode,
                            save_original_input=soi)
            with torch.no_grad():
                real = torch.ops.te_proto.linear_fwd(*args)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode_:
                fake_args = [mode_.from_tensor(a) if isinstance(a, torch.Tensor) else
                             [mode_.from_tensor(t) for t in a] if isinstance(a, list) else a for a in args]
                fake = torch.ops.te_proto.linear_fwd(*fake_args)
            for r, f in zip(real[:2], fake[:2]):
                assert (r.shape, r.dtype) == (f.shape, f.dtype)
            for what, rl, fl in (("saved", real[2], fake[2]), ("cache", real[3], fake[3])):
                assert len(rl) == len(fl), (rid, what, bias, irg, wrg, mode, soi)
                for r, f in zip(rl, fl):
                    assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), \
                        (rid, what, bias, irg, wrg, mode, soi)


# ---- te_proto::linear_bwd, called directly ------------------------------------------------------
def bwd_args(recipe, *, bias, input_rg, weight_rg, cache_mode=L.CACHE_OFF, save_original_input=False,
             fuse_wgrad_accumulation=False):
    """Run linear_fwd for real, then assemble linear_bwd's argument list as `_backward` does."""
    a = fwd_args(recipe, bias=bias, input_rg=input_rg, weight_rg=weight_rg, cache_mode=cache_mode,
                 save_original_input=save_original_input, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
    (x, w, b, scales, _grad_amax_state, cache, main_grad, key, flags, _prequantized) = a
    call = L.LinearCall.of(flags)
    with torch.no_grad():
        _, amaxes, saved, _ = torch.ops.te_proto.linear_fwd(*a)
    plan = linear_plan.plan_of(key, x, w, call)
    weight_amax = amaxes if plan.reuses_weight_amax else None
    raw_inp = x.detach() if plan.saves_raw_input() else None
    raw_w = w.detach() if plan.saves_raw_weight() else None
    used_cache = cache if call.cache_mode == L.CACHE_USE and call.input_requires_grad else []
    grad_out = torch.randn(TOKENS, OUT, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    return (grad_out, [s.detach() for s in saved], raw_inp, raw_w, used_cache, scales, weight_amax, main_grad, key,
            list(x.shape), list(w.shape), w.dtype, flags)


BWD_CASES = [
    pytest.param(rid, dict(bias=True, input_rg=True, weight_rg=True), id=f"{rid}-all")
    for rid in RECIPE_IDS
] + [
    pytest.param("delayed", dict(bias=False, input_rg=True, weight_rg=False), id="delayed-dgrad-only"),
    pytest.param("mxfp8", dict(bias=False, input_rg=False, weight_rg=True), id="mxfp8-wgrad-only"),
    pytest.param("current", dict(bias=True, input_rg=True, weight_rg=True, cache_mode=L.CACHE_USE),
                 id="current-cache-use"),
    pytest.param("nvfp4", dict(bias=False, input_rg=True, weight_rg=True, save_original_input=True),
                 id="nvfp4-save-original-input"),
    pytest.param("block", dict(bias=False, input_rg=True, weight_rg=True, fuse_wgrad_accumulation=True),
                 id="block-fuse-wgrad"),
    pytest.param("current", dict(bias=True, input_rg=False, weight_rg=False), id="current-bias-only"),
]


@pytest.mark.parametrize("rid,kw", BWD_CASES)
def test_opcheck_linear_bwd(fp8_harness, rid, kw):
    _opcheck(torch.ops.te_proto.linear_bwd.default, bwd_args(RECIPES[rid], **kw))


@pytest.mark.parametrize("rid", ["current", "mxfp8", "block", "nvfp4"])
def test_norm_quantize_and_prequantized_linear_opcheck(fp8_harness, rid):
    """The fused norm + quantize op, and linear_fwd fed its buffers (`inp_quantized`)."""
    recipe = RECIPES[rid]
    from transformer_engine_proto.custom_ops.linear import linear_fwd
    from transformer_engine_proto.custom_ops.norm import norm_quantize_fwd
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    key = RecipeKey.of(recipe)
    x = torch.randn(32, 64, requires_grad=True)
    g, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    torch.library.opcheck(norm_quantize_fwd, (x, g, b, 1e-5, "LayerNorm", False, key, True))
    ln, _, _, bufs = norm_quantize_fwd(x.detach(), g.detach(), b.detach(), 1e-5, "LayerNorm", False, key, True)
    w = torch.randn(32, 64, requires_grad=True)
    args = (ln.requires_grad_(), w, None, None, [], [], None, key, L.LinearCall(True, True).flags, bufs)
    torch.library.opcheck(linear_fwd, args)


def test_flags_round_trip_and_bad_cache_mode():
    for bools in itertools.product([False, True], repeat=5):
        for mode in (L.CACHE_OFF, L.CACHE_FILL, L.CACHE_USE):
            call = L.LinearCall(*bools, mode)
            assert L.LinearCall.of(call.flags) == call
    with pytest.raises(ValueError, match=r"cache_mode=3: expected CACHE_OFF, CACHE_FILL or CACHE_USE"):
        L.LinearCall(True, True, cache_mode=3)


@pytest.mark.parametrize("grad_on", [False, True])
def test_call_flags_match_the_call_description(grad_on):
    """`call_flags` (what `linear()` passes, integer work for dynamo) equals `LinearCall.flags`."""
    from transformer_engine_proto.custom_ops.linear_call import call_flags

    for irg, wrg, brg, soi, fuse in itertools.product([False, True], repeat=5):
        x, w = torch.zeros(2, 4, requires_grad=irg), torch.zeros(3, 4, requires_grad=wrg)
        b = torch.zeros(3, requires_grad=brg)
        with torch.set_grad_enabled(grad_on):
            flags = call_flags(x, w, b, L.CACHE_FILL, soi, fuse)
        want = L.LinearCall(grad_on and irg, grad_on and wrg, grad_on and brg, soi, fuse and grad_on and wrg,
                            L.CACHE_FILL)
        assert L.LinearCall.of(flags) == want
    with pytest.raises(ValueError, match=r"cache_mode=5"):
        call_flags(x, w, None, 5)
