"""`te.autocast` is per thread, as `torch.autocast` is: a thread sees only the autocast blocks it
entered, eager and compiled, and may enter one while another thread compiles."""
import threading

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe
from transformer_engine_proto.quantization import FP8GlobalStateManager

WAIT = 120  # seconds: a broken test fails instead of hanging


@pytest.fixture(autouse=True)
def _no_autocast_left_behind():
    yield
    FP8GlobalStateManager.reset()  # a failing run must not leave autocast on for later tests


def _run_threads(*fns):
    """Run each function in its own thread; re-raise the first error (a broken barrier last)."""
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]


def _layer(seed=0):
    torch.manual_seed(seed)
    return te.Linear(32, 32), torch.randn(16, 32)


@pytest.mark.parametrize("make_recipe", [recipe.Float8CurrentScaling, recipe.NVFP4BlockScaling])
def test_thread_without_autocast_runs_high_precision_while_another_is_inside(make_recipe):
    m, x = _layer()
    ref = m(x)
    with te.autocast(recipe=make_recipe()):
        quantized = m(x)
    assert not torch.equal(quantized, ref)
    inside, done = threading.Barrier(2, timeout=WAIT), threading.Event()
    seen = {}

    def in_autocast():
        with te.autocast(recipe=make_recipe()):
            inside.wait()
            seen["a"] = m(x)
            assert done.wait(WAIT)

    def plain():
        inside.wait()
        seen["enabled"], seen["recipe"] = te.is_fp8_enabled(), te.get_fp8_recipe()
        seen["b"] = m(x)
        done.set()

    _run_threads(in_autocast, plain)
    assert seen["enabled"] is False and seen["recipe"] is None
    assert torch.equal(seen["b"], ref)
    assert torch.equal(seen["a"], quantized)


def test_overlapping_blocks_exited_in_crossed_order_leave_autocast_off_everywhere():
    m, x = _layer()
    ref = m(x)
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))
    seen = {}

    def first_in_first_out():
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            a_in.set()
            assert b_in.wait(WAIT)
        a_out.set()
        assert b_out.wait(WAIT)
        seen["a"] = te.is_fp8_enabled(), te.get_fp8_recipe()

    def second_in_last_out():
        assert a_in.wait(WAIT)
        with te.autocast(recipe=recipe.MXFP8BlockScaling()):
            b_in.set()
            assert a_out.wait(WAIT)
            seen["b_inside"] = type(te.get_fp8_recipe())
        b_out.set()
        seen["b"] = te.is_fp8_enabled(), te.get_fp8_recipe()

    _run_threads(first_in_first_out, second_in_last_out)
    assert seen["b_inside"] is recipe.MXFP8BlockScaling
    assert seen["a"] == (False, None) and seen["b"] == (False, None)
    assert te.is_fp8_enabled() is False and te.get_fp8_recipe() is None
    assert torch.equal(m(x), ref)


def test_autocast_entered_in_one_thread_while_another_compiles():
    """The compiling thread waits inside its backend (mid-compile) until the other thread has
    entered and left autocast twice, so the overlap does not depend on thread timing."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    m_a, x_a = _layer(0)
    m_b, x_b = _layer(1)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        want_a = m_a(x_a)
    with te.autocast(recipe=recipe.MXFP8BlockScaling()):
        want_b = m_b(x_b)
    two_blocks_done, compiled_done = threading.Event(), threading.Event()
    seen = {"b_blocks": 0}

    def waiting_compiler(gm, _inputs):
        seen["compiling"] = True
        assert two_blocks_done.wait(WAIT), "the other thread never left its autocast block"
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=waiting_compiler, bw_compiler=make_boxed_func)
    compiled = torch.compile(m_a, backend=backend, fullgraph=True)

    def compile_and_run():
        try:
            with te.autocast(recipe=recipe.Float8CurrentScaling()):
                seen["a"] = compiled(x_a)
        finally:
            compiled_done.set()

    def enter_and_exit():
        while not compiled_done.is_set():
            with te.autocast(recipe=recipe.MXFP8BlockScaling()):
                assert torch.equal(m_b(x_b), want_b)
            assert te.is_fp8_enabled() is False
            seen["b_blocks"] += 1
            if seen["b_blocks"] >= 2 and seen.get("compiling"):
                two_blocks_done.set()

    _run_threads(compile_and_run, enter_and_exit)
    assert seen["compiling"] and seen["b_blocks"] >= 2
    assert torch.equal(seen["a"], want_a)


def test_compiled_layer_follows_the_calling_threads_autocast():
    """Dynamo's guards read the autocast state of the thread that calls the compiled code."""
    m, x = _layer()
    ref = m(x)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        want = m(x)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    seen = {}

    def plain():
        seen["b"] = compiled(x)

    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        assert torch.equal(compiled(x), want)
        _run_threads(plain)
        assert torch.equal(compiled(x), want)
    assert torch.equal(seen["b"], ref)


def test_shared_input_entries_are_per_thread():
    """One thread's autocast exit clears only its own shared quantized inputs, and a scope opened
    in one thread is not seen by another."""
    import threading

    from transformer_engine_proto.custom_ops import shared_input

    x = torch.randn(8, 8)
    ready, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        with shared_input.scope():
            shared_input.store(x, "k", [torch.ones(1)])
        seen["stored"] = dict(shared_input._local.entries)
        ready.set()
        done.wait(10)
        seen["after"] = len(shared_input._local.entries)
        with shared_input.scope():
            seen["hit"] = shared_input.lookup(x, "k")

    t = threading.Thread(target=other)
    t.start()
    assert ready.wait(10)
    assert shared_input.lookup(x, "k") is None  # no scope in this thread
    shared_input.clear()  # this thread's autocast exit
    done.set()
    t.join(10)
    assert len(seen["stored"]) == 1
    assert seen["after"] == 1  # survived the main thread's clear
    assert seen["hit"] is not None and torch.equal(seen["hit"][0], torch.ones(1))
