"""te.checkpoint: the recomputed forward uses the first forward's scales and records no amax, so
a checkpointed model trains bit for bit like the plain one (loss, grads, weights, delayed-scaling
amax history and scales), eagerly (reentrant and not) and under torch.compile."""
import copy
import itertools

import pytest
import torch
from compile_cases import assert_matches_eager, compile_for
from linear_cases import (
    RECIPE_IDS,
    RECIPES,
    backend_params,
    fold_last_grad_amaxes,
    fresh_dynamo,
    graph_breaks,
    recipe_ctx,
)

import transformer_engine_proto as te
from transformer_engine_proto import recompute as te_recompute
from transformer_engine_proto.module.quantized_gemm import QuantizedGemm

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = te.LayerNormLinear(32, 64)
        self.fc2 = te.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.mode = mode  # None, "reentrant", "non_reentrant", "torch" (plain torch.utils.checkpoint)

    def forward(self, x):
        for b in self.blocks:
            if self.mode is None:
                x = b(x)
            elif self.mode == "torch":
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = te.checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return x


def _train(model, recipe, steps=STEPS, compiled=None, backward_in_autocast=False, batch=64):
    torch.manual_seed(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = compiled if compiled is not None else model
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, 32, requires_grad=True)
        with recipe_ctx(recipe):
            loss = fn(x).square().mean()
            if backward_in_autocast:
                loss.backward()
        if not backward_in_autocast:
            loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
        opt.step()
        opt.zero_grad()
    fold_last_grad_amaxes(recipe)
    return losses, grads


def _pair(mode):
    torch.manual_seed(0)
    ref = Model(None)
    ck = copy.deepcopy(ref)
    ck.mode = mode
    return ref, ck


def _assert_same(ref, ck, results_ref, results_ck, backend="aot_eager"):
    (l1, g1), (l2, g2) = results_ref, results_ck
    for i, (a, b) in enumerate(zip(l1 + g1, l2 + g2)):
        assert_matches_eager(b, a, backend, f"loss / grad {i}")
    ck_tensors = dict(itertools.chain(ck.named_parameters(), ck.named_buffers()))
    for n, a in itertools.chain(ref.named_parameters(), ref.named_buffers()):
        assert_matches_eager(ck_tensors[n].detach(), a.detach(), backend, n)  # weights, delayed-scaling state


@pytest.mark.parametrize("rid", RECIPE_IDS)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_trains_like_the_plain_model(rid, mode, monkeypatch):
    recipe = RECIPES[rid]
    ref, ck = _pair(mode)
    updates, ops = [], []
    real_update, real_forward = QuantizedGemm.update_scales, QuantizedGemm.forward
    monkeypatch.setattr(QuantizedGemm, "update_scales",
                        lambda self, r, *a: updates.append(1) or real_update(self, r, *a))
    monkeypatch.setattr(QuantizedGemm, "forward", lambda self, *a, **k: ops.append(1) or real_forward(self, *a, **k))
    r_ref = _train(ref, recipe)
    n_updates, n_ops = len(updates), len(ops)
    r_ck = _train(ck, recipe)
    _assert_same(ref, ck, r_ref, r_ck)
    assert len(ops) - n_ops == 2 * n_ops  # the checkpointed run did recompute every GEMM
    assert len(updates) - n_updates == n_updates  # ... and updated the scales once per step
    if rid == "delayed":  # the histories compared above did move
        h = ref.blocks[0].fc2.gemm.amax_history
        assert h[-STEPS:].gt(0).all() and not h[0].any()  # rolled at each exit: the steps at the end


def test_plain_torch_checkpoint_recomputes_without_the_recipe():
    """The control: torch.utils.checkpoint with backward after autocast's exit recomputes in high
    precision (no recipe then), which saves other tensors than the FP8 forward did: torch refuses.
    te.checkpoint puts the first forward's recipe and scales back."""
    _, ck = _pair("torch")
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number of tensors"):
        _train(ck, RECIPES["delayed"])


def test_recompute_phase_flag_is_seen_only_in_recompute():
    seen = []
    lin = te.Linear(32, 32)

    def fn(x):
        seen.append(te.quantization.FP8GlobalStateManager.in_fp8_activation_recompute_phase())
        seen.append(te.get_fp8_recipe() is not None)
        return lin(x)

    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=RECIPES["current"]):
        y = te.checkpoint(fn, x, use_reentrant=False)
    y.sum().backward()  # outside autocast: the recompute still runs with the recipe
    assert seen == [False, True, True, True]
    assert te.distributed.checkpoint is te.checkpoint


def _backend(backward_graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def fw(gm, _):
        return make_boxed_func(gm.forward)

    def bw(gm, _):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    # aot_eager's partitioner, with the backward graph kept for inspection
    return aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


def _recomputed_linears(graphs) -> int:
    return sum(n.target is torch.ops.te_proto.linear_fwd.default for g in graphs for n in g.graph.nodes)


@pytest.mark.parametrize("backend, rid", backend_params(["delayed", "current", "mxfp8"]))
def test_checkpoint_compiled_matches_plain_eager(backend, rid, monkeypatch):
    """fullgraph, checkpoint inside the compiled model: no graph break, the backward graph does
    recompute the Linear forwards (checked on aot_eager's partitioner), and the run is bit for bit
    the plain eager one (losses, grads, weights, delayed-scaling buffers; under inductor see
    compile_cases). Activations (256 x 32) are above the save threshold, the scaling state
    (1024 x 2) below it."""
    monkeypatch.setattr(te_recompute, "SMALL_NUMEL", 4096)
    recipe = RECIPES[rid]
    ref, ck = _pair("reentrant")  # reentrant is eager only: under compile te.checkpoint traces the other one
    fresh_dynamo()
    graphs = []
    compiled = torch.compile(ck, fullgraph=True, backend=_backend(graphs)) if backend == "aot_eager" \
        else compile_for(ck, backend)
    r_ref = _train(ref, recipe, batch=256)
    r_ck = _train(ck, recipe, compiled=compiled, batch=256)
    assert graph_breaks() == 0
    if backend == "aot_eager":
        assert _recomputed_linears(graphs) == 4
    _assert_same(ref, ck, r_ref, r_ck, backend)


def test_compiled_recompute_of_everything_matches_eager(monkeypatch):
    """Recompute everything (threshold 0): the delayed-scaling update runs at autocast's exit and
    entry, outside the compiled graphs, so a replayed forward cannot read an updated history and
    the checkpointed compiled model still trains like eager."""
    monkeypatch.setattr(te_recompute, "SMALL_NUMEL", 0)
    ref, ck = _pair("non_reentrant")
    fresh_dynamo()
    compiled = torch.compile(ck, fullgraph=True, backend="aot_eager")
    r_ref = _train(ref, RECIPES["delayed"], batch=256)
    r_ck = _train(ck, RECIPES["delayed"], compiled=compiled, batch=256)
    _assert_same(ref, ck, r_ref, r_ck)


def test_unsupported_arguments():
    lin = te.Linear(32, 32)
    x = torch.randn(4, 32)
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.checkpoint(lin, x, distribute_saved_activations=True)
    with pytest.raises(NotImplementedError, match="get_rng_state_tracker"):
        te.checkpoint(lin, x, get_rng_state_tracker=lambda: None)


def _cuda_pair():
    """`_pair("non_reentrant")` moved to the GPU in bf16."""
    ref, ck = _pair("non_reentrant")
    return ref.to("cuda", torch.bfloat16), ck.to("cuda", torch.bfloat16)


def _train_on_cuda(ref, ck, recipe, batch, compiled=None):
    """`_train` of both models with the GPU and bf16 as torch's defaults (the inputs it draws)."""
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    try:
        return _train(ref, recipe, batch=batch), _train(ck, recipe, compiled=compiled, batch=batch)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_cuda_checkpoint_trains_like_the_plain_model(rid):
    """On the GPU (Triton quantize kernels, torch._scaled_mm): te.checkpoint, eager, bit for bit."""
    ref, ck = _cuda_pair()
    r_ref, r_ck = _train_on_cuda(ref, ck, RECIPES[rid], batch=128)
    _assert_same(ref, ck, r_ref, r_ck)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_checkpoint_compiled_matches_plain_eager(backend, monkeypatch):
    """On the GPU (Triton quantize kernels, torch._scaled_mm), compiled, delayed scaling: the
    checkpointed region's recompute records no amax again, and the run matches the plain eager one
    (losses, grads, weights, the delayed-scaling state)."""
    monkeypatch.setattr(te_recompute, "SMALL_NUMEL", 4096)
    ref, ck = _cuda_pair()
    fresh_dynamo()
    r_ref, r_ck = _train_on_cuda(ref, ck, RECIPES["delayed"], batch=256, compiled=compile_for(ck, backend))
    assert graph_breaks() == 0
    _assert_same(ref, ck, r_ref, r_ck, backend)
