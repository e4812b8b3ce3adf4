"""te.convert_model: any model's nn.Linear / norms onto te modules in place, keeping parameters,
ties, dtypes, devices and names; unconvertible layers listed once; the example runs."""
import copy
import sys
import warnings

import pytest
import torch
from compile_cases import assert_matches_eager
from linear_cases import backend_params
from torch import nn

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.module import convert as convert_mod

transformers = pytest.importorskip("transformers")


def _llama(dtype=torch.float32, layers=1, device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _ids(n=2, seq=16, vocab=128):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))


def _convert_quiet(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", te.ConversionWarning)  # these models have nothing to skip
        return te.convert_model(model, **kw)


class TinyGPT(nn.Module):
    """nanoGPT's layout: LayerNorm, fused qkv Linear, MLP, lm_head tied to the token embedding."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.ln_1, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, -1)
        x = x + self.c_proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + self.mlp(x)
        return self.lm_head(self.ln_f(x))


# ---- nanoGPT: tied weights, optimizer made before conversion ---------------------------------
def test_tied_lm_head_stays_tied_and_trains():
    torch.manual_seed(0)
    model = TinyGPT()
    params_before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made BEFORE conversion
    _convert_quiet(model, convert_norms=True)
    assert isinstance(model.lm_head, te.Linear) and isinstance(model.ln_f, te.LayerNorm)
    assert model.lm_head.weight is model.wte.weight
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]
    idx = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    before = model.wte.weight.detach().clone()
    losses = []
    for _ in range(3):
        with te.autocast(recipe=R.Float8CurrentScaling()):
            logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.lm_head.weight is model.wte.weight
    assert not torch.equal(model.wte.weight, before)  # the optimizer still holds the live parameter
    assert losses[-1] < losses[0], losses


# ---- Hugging Face Llama ---------------------------------------------------------------------
def test_llama_same_output_and_grads_in_high_precision():
    ref = _llama()
    model = copy.deepcopy(ref)
    _convert_quiet(model, convert_norms=True)
    n_norms = sum(type(m).__name__ == "LlamaRMSNorm" for m in ref.modules())
    assert n_norms == 3 and sum(isinstance(m, te.RMSNorm) for m in model.modules()) == n_norms
    assert not any(type(m) in (nn.Linear,) or type(m).__name__ == "LlamaRMSNorm" for m in model.modules())
    assert sum(isinstance(m, te.Linear) for m in model.modules()) == 8
    assert model.model.norm.eps == ref.model.norm.variance_epsilon
    ids = _ids()
    out_ref, out = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    out_ref.loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert list(grads) == list(ref_grads)  # the same parameter names, in the same order
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_llama_with_a_recipe_trains_close_to_high_precision():
    ref = _llama()
    model = _convert_quiet(copy.deepcopy(ref), convert_norms=True)
    ids = _ids()
    with te.autocast(recipe=R.Float8CurrentScaling()):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref = ref(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss.item() != loss_ref.item()  # really quantized
    assert abs(loss.item() - loss_ref.item()) < 0.02 * loss_ref.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", backend_params())
def test_llama_compiles_fullgraph_and_matches_eager(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _convert_quiet(_llama(), convert_norms=True)
    ids = _ids()
    recipe = R.Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    eager_grad = model.model.layers[0].mlp.down_proj.weight.grad.clone()
    model.zero_grad()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with te.autocast(recipe=recipe):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert counter.frame_count == 1  # fullgraph: one frame, no graph break
    assert_matches_eager(loss, eager, backend, "loss")
    assert_matches_eager(model.model.layers[0].mlp.down_proj.weight.grad, eager_grad, backend, "down_proj wgrad")


def test_bf16_llama():
    ref = _llama(torch.bfloat16)
    model = _convert_quiet(copy.deepcopy(ref), convert_norms=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.layers[0].self_attn.q_proj.gemm.fp8_scale.dtype == torch.float32
    ids = _ids()
    with torch.no_grad():
        logits, logits_ref = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    # te's RMSNorm rounds once where HF's rounds twice: bf16 noise, not a different function
    torch.testing.assert_close(logits, logits_ref, rtol=0.05, atol=0.05)
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.lm_head.weight.grad).all()


def test_state_dict_round_trips_with_the_unconverted_model():
    """A converted model's checkpoint, its `_extra_state` entries (the FP8 state, TE's layout) left
    out, loads into the plain HF model (norms included) with strict=True, and back."""
    model = _convert_quiet(_llama(), convert_norms=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from their init of ones
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
        model(input_ids=_ids(), labels=_ids()).loss.backward()  # some FP8 state to carry
    model.zero_grad(set_to_none=True)
    state = model.state_dict()
    extra = [k for k in state if k.endswith("._extra_state")]
    assert extra and all(k.endswith(("_proj._extra_state", "lm_head._extra_state")) for k in extra)
    plain = _llama()
    plain.load_state_dict({k: v for k, v in state.items() if k not in extra})  # strict
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    fresh = _convert_quiet(_llama(), convert_norms=True)
    fresh.load_state_dict(plain.state_dict())  # strict: no FP8 state, so it starts fresh
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    fresh.load_state_dict(state)  # the converted checkpoint, FP8 state included
    q, q_fresh = model.model.layers[0].self_attn.q_proj.gemm, fresh.model.layers[0].self_attn.q_proj.gemm
    assert torch.equal(q.amax_history, q_fresh.amax_history) and torch.equal(q.fp8_scale, q_fresh.fp8_scale)


def test_to_dtype_after_conversion_equals_converting_a_bf16_model():
    """model.to(bf16) casts the parameters and leaves te's float32 scaling state alone."""
    a = _convert_quiet(_llama(torch.float32), convert_norms=True).to(torch.bfloat16)
    b = _convert_quiet(_llama(torch.float32).to(torch.bfloat16), convert_norms=True)
    gemm = a.model.layers[0].self_attn.q_proj.gemm
    assert gemm.fp8_scale.dtype == gemm.amax_history.dtype == gemm.grad_amax_seen.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    ids = _ids()
    recipe = R.DelayedScaling(amax_history_len=4)
    for _ in range(3):  # delayed scaling: the scales come from the (float32) state of earlier steps
        losses = []
        for m in (a, b):
            with te.autocast(recipe=recipe):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    torch.testing.assert_close(a.model.layers[0].self_attn.q_proj.gemm.fp8_scale,
                               b.model.layers[0].self_attn.q_proj.gemm.fp8_scale, rtol=0, atol=0)


# ---- options and bookkeeping ----------------------------------------------------------------
def test_filter_function_gets_qualified_names_and_decides():
    model = _llama()
    seen = []

    def keep_attention(module, fqn):
        seen.append((fqn, type(module)))
        return "self_attn" in fqn

    _convert_quiet(model, module_filter_fn=keep_attention)
    linears = {name: type(m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, te.Linear))}
    assert {n for n, t in linears.items() if t is te.Linear} == {
        f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"}
    assert linears["lm_head"] is nn.Linear and linears["model.layers.0.mlp.up_proj"] is nn.Linear
    assert ("lm_head", nn.Linear) in seen and all(t is nn.Linear for _, t in seen)  # norms not asked


def test_names_are_qualified_module_names():
    model = _convert_quiet(_llama(), convert_norms=True)
    te_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, (te.Linear, te.RMSNorm))]
    assert len(te_modules) == 11
    assert all(m.name == n for n, m in te_modules)
    assert model.model.layers[0].self_attn.q_proj.name == "model.layers.0.self_attn.q_proj"


class MyRMSNorm(nn.Module):  # unknown semantics: listed, never converted
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * (1 + self.weight)


def _mixed_model():
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 100), nn.Linear(100, 48), nn.Linear(48, 64),
                         nn.LayerNorm(64, bias=False), nn.RMSNorm(64, elementwise_affine=False),
                         nn.LayerNorm((4, 16)), MyRMSNorm(64), nn.RMSNorm(64), nn.LayerNorm(64))


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, te.ConversionWarning)]


def test_unconvertible_layers_listed_in_one_warning_and_idempotent():
    model = _mixed_model()
    caught = _caught(lambda: te.convert_model(model, convert_norms=True, recipe=R.MXFP8BlockScaling()))
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert msg.startswith("convert_model: 7 layer(s) left in high precision"), msg
    lines = {line.split()[0]: line for line in msg.splitlines()[1:]}
    expected = {"1": "not both multiples of 16", "2": "not both multiples of 16", "3": "MXFP8BlockScaling: MXFP8",
                "4": "bias=False", "5": "elementwise_affine=False", "6": "more than the last dim", "7": "MyRMSNorm"}
    assert lines.keys() == expected.keys(), msg
    assert all(why in lines[fqn] for fqn, why in expected.items()), msg
    kinds = [type(m) for m in model]
    assert kinds[0] is te.Linear and kinds[8] is te.RMSNorm and kinds[9] is te.LayerNorm
    assert kinds[1:8] == [type(m) for m in list(_mixed_model())[1:8]]
    before = list(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert _caught(lambda: te.convert_model(model, convert_norms=True, recipe=R.MXFP8BlockScaling())) == []
    assert all(a is b for a, b in zip(model, before))
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_min_multiple_and_recipe_rules():
    model = _mixed_model()
    _caught(lambda: te.convert_model(model, min_multiple=1))  # per-tensor FP8: any shape
    assert [type(m) for m in list(model)[:4]] == [te.Linear] * 4
    model = _mixed_model()
    _caught(lambda: te.convert_model(model, min_multiple=1, recipe=[R.Float8CurrentScaling(), R.NVFP4BlockScaling()]))
    assert [type(m) for m in list(model)[:4]] == [te.Linear, nn.Linear, nn.Linear, te.Linear]


def test_torch_norms_match_and_rmsnorm_eps_none_is_float32_epsilon():
    model = nn.Sequential(nn.RMSNorm(64), nn.LayerNorm(64, eps=1e-3))
    with torch.no_grad():
        for m in model:
            m.weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    ref = copy.deepcopy(model)
    _convert_quiet(model, convert_norms=True)
    assert model[0].eps == torch.finfo(torch.float32).eps and model[1].eps == 1e-3
    x = torch.randn(8, 64) * 1e-3  # small values: eps matters (torch uses float32's eps for bf16 too)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype), ref.to(dtype)
        torch.testing.assert_close(model(x.to(dtype)), ref(x.to(dtype)), **(
            dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)))


def test_shared_module_converted_once_and_frozen_params_kept():
    shared = nn.Linear(32, 32)
    shared.bias.requires_grad_(False)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    _convert_quiet(model)
    assert model[0] is model[2] and isinstance(model[0], te.Linear) and model[0].name == "0"
    assert model[0].bias is shared.bias and not model[0].bias.requires_grad and model[0].weight.requires_grad


def test_device_kept_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64))
    _convert_quiet(model, convert_norms=True)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def test_root_module_is_converted_and_returned():
    lin = nn.Linear(16, 16)
    new = _convert_quiet(lin)
    assert isinstance(new, te.Linear) and new.weight is lin.weight


def test_sharded_or_quantized_weights_are_left_alone():
    lin = nn.Linear(32, 32)
    lin.weight = nn.Parameter(lin.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    caught = _caught(lambda: te.convert_model(nn.Sequential(lin)))
    assert len(caught) == 1 and "float8_e4m3fn" in str(caught[0].message)


def test_no_transformers_hf_rmsnorm_check_is_false(monkeypatch):
    monkeypatch.setattr(convert_mod, "_llama_rmsnorm_code", lambda: None)
    assert not convert_mod._is_hf_llama_rmsnorm(_llama().model.norm)


# ---- the example ----------------------------------------------------------------------------
def test_hf_llama_example_runs():
    from transformer_engine_proto.examples import hf_llama

    results = hf_llama.main(["--steps", "2", "--no-compile", "--device", "cpu", "--recipe", "mxfp8"])
    assert list(results) == ["unconverted", "te + mxfp8"]  # mxfp8: the token count is a multiple of 32
    assert all(len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) for losses, _ in results.values())


def test_hf_llama_example_names_the_extra_without_transformers(monkeypatch):
    from transformer_engine_proto.examples import hf_llama

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[hf\]"'):
        hf_llama.main(["--steps", "1", "--device", "cpu"])
