"""Triton KDA kernels vs the torch paths (outputs, final states, gradients) and the kernel dispatch.

With CUDA the kernels run on the GPU. Without it they run on CPU through the Triton interpreter, which
only works when triton is imported with ``TRITON_INTERPRET=1``. If this module is the first to import
triton (no CUDA) it sets the variable for the rest of the process and runs the kernels in-process.
Otherwise (the usual case: ``import kimi_vl`` pulls in triton via torch._dynamo) the selected tests of this
module run once, together, in a child pytest process started with the variable set, and each test here
reports its own outcome from that run. Shapes are tiny: the interpreter is slow (2-3 minutes for the default
selection, on one core), so ``tests/kernels/conftest.py`` starts the child as soon as collection ends and moves this
module to the end of the session: the child runs beside every other test; the first test here waits for what is left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
    import importlib.util

    if importlib.util.find_spec("torch") is not None and not __import__("torch").cuda.is_available():
        # Kept set for the rest of this process: once triton's own library is interpreted, any kernel
        # defined later must be interpreted too.
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from kimi_vl.kernels import kda as kda_mod
from tests.kernels.test_kda import NAMES, make_inputs, run

ROOT = Path(__file__).resolve().parents[2]


def _setup_mode() -> str | None:
    """Device to run the kernels on in this process ("cuda"/"cpu"), or None: run them in a child process."""
    if torch.cuda.is_available():
        return "cuda"
    from triton.runtime.interpreter import InterpretedFunction

    from kimi_vl.kernels import kda_triton

    ok = kda_triton.interpreting() and isinstance(kda_triton._chunk_state_kernel, InterpretedFunction)
    return "cpu" if ok else None


MODE = _setup_mode()
_CHILD: dict[str, str] = {}  # test name -> "" (passed) or the failure text, from the child pytest run


@pytest.fixture(autouse=True)
def _current_test(request):
    _current_test.name = request.node.name
    yield


_CHILD_RUN: dict = {}  # the child pytest process: "proc", its output folder "out" and log file "log"


def start_child(items: list[pytest.Item], config: pytest.Config) -> None:
    """Start the child pytest that runs this module's tests among the session's selected `items` in the interpreter,
    in the background; stopped and cleaned up when the session ends."""
    me = Path(__file__).resolve()
    nodeids = [it.nodeid for it in items if Path(str(it.path)).resolve() == me]
    if MODE is not None or _CHILD_RUN or not nodeids:
        return
    out = Path(tempfile.mkdtemp(prefix="kda_triton_"))
    log = (out / "output.txt").open("w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", f"--junitxml={out / 'report.xml'}",
           *nodeids]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)
    _CHILD_RUN.update(proc=proc, out=out, log=log)
    config.add_cleanup(_stop_child)


def _stop_child() -> None:
    proc = _CHILD_RUN.pop("proc")
    if proc.poll() is None:  # the session ended first (interrupted, -x)
        proc.kill()
        proc.wait()
    _CHILD_RUN.pop("log").close()
    shutil.rmtree(_CHILD_RUN.pop("out"), ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _child_run(request):
    """Without an in-process interpreter: collect the outcomes of the child run (started here if no hook did)."""
    if MODE is not None:
        yield
        return
    start_child(request.session.items, request.config)  # already started by tests/kernels/conftest.py's hook
    proc, out = _CHILD_RUN["proc"], _CHILD_RUN["out"]
    try:
        proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    report = out / "report.xml"
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            bad = [c for c in case if c.tag in ("failure", "error")]
            _CHILD[case.get("name")] = "\n".join((c.get("message") or "") + "\n" + (c.text or "") for c in bad)
    _CHILD["__output__"] = (out / "output.txt").read_text()[-6000:]
    yield


def _run_case(name: str, **params) -> None:
    """Run the module-level case ``name`` here, or report its outcome from the child pytest run."""
    if MODE is not None:
        globals()[name](MODE, **params)
        return
    test = _current_test.name
    assert test in _CHILD, f"{test} did not run in the interpreter child process:\n{_CHILD.get('__output__')}"
    assert not _CHILD[test], _CHILD[test]


def _triton_env(fn):
    """Run ``fn()`` with ``KIMI_VL_KERNELS=triton`` (restoring the previous value)."""
    prev = os.environ.get("KIMI_VL_KERNELS")
    os.environ["KIMI_VL_KERNELS"] = "triton"
    try:
        return fn()
    finally:
        if prev is None:
            del os.environ["KIMI_VL_KERNELS"]
        else:
            os.environ["KIMI_VL_KERNELS"] = prev


def _inputs(device, T, D, B=2, H=2, n_state=None, l2=True, gate_div=1.0, seed=0, dtype=torch.float32):
    inputs = make_inputs(B=B, T=T, H=H, Dk=D, Dv=D, n_state=n_state, gate_div=gate_div, seed=seed)
    if not l2:  # the delta rule is only stable for |k| <= 1: normalise outside the kernel instead
        inputs[:2] = [F.normalize(x, dim=-1) for x in inputs[:2]]
    return [x.to(device=device, dtype=dtype) for x in inputs]


def _assert_close(out: dict, ref: dict, tol: float = 1e-4, names=NAMES) -> None:
    for name in names:
        a, b = out[name].double().cpu(), ref[name].double().cpu()
        assert torch.isfinite(a).all(), name
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err < tol, f"{name}: max abs diff {err:.3g}"


# ---------------------------------------------------------------------------------------------- cases


def case_recurrent(device, T, D, use_h0, l2, varlen=False):
    from kimi_vl.kernels.kda_triton import fused_recurrent_kda_triton

    kw = dict(use_qk_l2norm=l2, scale=0.3)
    if varlen:
        offsets = [0, T // 5, T // 2, T]
        kw["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32, device=device)
        inputs = _inputs(device, T, D, B=1, n_state=3, l2=l2)
    else:
        inputs = _inputs(device, T, D, l2=l2)
    q, k, v, g, beta, h0 = inputs
    h0 = h0 if use_h0 else None
    o, ht = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    o_ref, ht_ref = kda_mod.fused_recurrent_kda_torch(q, k, v, g, beta, initial_state=h0,
                                                      output_final_state=True, **kw)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    _assert_close({"o": o, "ht": ht}, {"o": o_ref, "ht": ht_ref}, names=("o", "ht"))
    o2, none = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=h0, **kw)
    assert none is None  # the same output: bit for bit in the interpreter; compiled, the kernel without the state
    torch.testing.assert_close(o2, o, rtol=0, atol=1e-5)  # store is another program (rounding may move)


def case_chunk(device, T, D, use_h0, l2, gate_div=1.0, varlen=False, hard_reset=False):
    if varlen:
        offsets = [0, T // 5, T // 2, T]
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        inputs = _inputs(device, T, D, B=1, n_state=3, l2=l2, gate_div=gate_div)
    else:
        cu, inputs = None, _inputs(device, T, D, l2=l2, gate_div=gate_div)
    if hard_reset:  # fla-test style: some positions fully reset the state
        g = inputs[3]
        inputs[3] = torch.where(torch.rand(g.shape[:3], generator=torch.Generator().manual_seed(3))
                                .to(device)[..., None] < 0.1, torch.full_like(g, -1000.0), g)
    kw = dict(use_h0=use_h0, use_qk_l2norm=l2, cu_seqlens=cu)
    ref = run(kda_mod.chunk_kda_torch, inputs, **kw)
    out = _triton_env(lambda: run(kda_mod.chunk_kda, inputs, **kw))
    _assert_close(out, ref)  # -1000 counts as GATE_FLOOR (-87.3) in both: no cancellation in G after a reset


def case_chunk_infinite_gates(device):
    """-inf gates (hard resets) match the float64 reference: no -inf - -inf NaN in the kernels' cumulative sums."""
    q, k, v, g, beta, h0 = make_inputs(B=1, T=70, H=2, Dk=16, Dv=16, gate_div=10.0)
    g[:, [3, 40]] = float("-inf")
    ref = run(kda_mod.naive_recurrent_kda, [q, k, v, g, beta, h0], use_qk_l2norm=True)
    inputs = [x.to(device=device, dtype=torch.float32) for x in (q, k, v, g, beta, h0)]
    out = _triton_env(lambda: run(kda_mod.chunk_kda, inputs, use_qk_l2norm=True))
    _assert_close(out, ref, names=("o", "ht", "dq", "dk", "dv", "dbeta", "dh0"))


def case_triton_is_used(device):
    """With KIMI_VL_KERNELS=triton the public ops run the kernels (grad_fn is the Triton Function)."""
    q, k, v, g, beta, h0 = _inputs(device, 20, 16)
    q.requires_grad_()

    def go():
        o, _ = kda_mod.chunk_kda(q, k, v, g, beta, use_qk_l2norm=True)
        with torch.no_grad():
            o_rec, _ = kda_mod.fused_recurrent_kda(q, k, v, g, beta, use_qk_l2norm=True)
        return o, o_rec

    o, o_rec = _triton_env(go)
    assert type(o.grad_fn).__name__ == "ChunkKDAFunctionBackward"
    assert (o_rec - o).abs().max().item() < 1e-4


def case_recurrent_with_grad_falls_back(device):
    inputs = _inputs(device, 9, 16)
    ref = run(kda_mod.fused_recurrent_kda_torch, inputs, use_qk_l2norm=True)
    out = _triton_env(lambda: run(kda_mod.fused_recurrent_kda, inputs, use_qk_l2norm=True))
    _assert_close(out, ref, tol=1e-6)


def case_odd_dims(device):
    """Dk, Dv that are not powers of two (masked lanes), and Dk < 16 (as in the tiny model)."""
    for dk, dv, T in ((20, 24, 70), (8, 8, 17)):
        inputs = make_inputs(B=1, T=T, H=2, Dk=dk, Dv=dv)
        inputs = [x.to(device=device, dtype=torch.float32) for x in inputs]
        ref = run(kda_mod.chunk_kda_torch, inputs, use_qk_l2norm=True)
        out = _triton_env(lambda inputs=inputs: run(kda_mod.chunk_kda, inputs, use_qk_l2norm=True))
        _assert_close(out, ref)
        from kimi_vl.kernels.kda_triton import fused_recurrent_kda_triton

        q, k, v, g, beta, h0 = inputs
        o, ht = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm=True)
        _assert_close({"o": o, "ht": ht}, ref, names=("o", "ht"))


def case_empty_time_axis(device):
    """T = 0 (the ops take any T): empty outputs and the initial states back, as the torch paths give, with and
    without packed (all empty) sequences."""
    def go():
        for B, cu in ((2, None), (1, torch.tensor([0, 0, 0], dtype=torch.int32, device=device))):
            q, k, v, g, beta, h0 = _inputs(device, 0, 16, B=B, n_state=2)
            for fn in (kda_mod.chunk_kda, kda_mod.fused_recurrent_kda):
                o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
                assert o.shape == (B, 0, 2, 16)
                torch.testing.assert_close(ht, h0, rtol=0, atol=0)

    _triton_env(go)


def case_bf16(device):
    from kimi_vl.kernels.kda_triton import chunk_kda_triton, fused_recurrent_kda_triton

    q, k, v, g, beta, h0 = _inputs(device, 70, 32, dtype=torch.bfloat16)
    ref, ref_ht = kda_mod.chunk_kda_torch(q, k, v, g, beta, initial_state=h0.float(), output_final_state=True,
                                          use_qk_l2norm=True)
    for fn in (chunk_kda_triton, fused_recurrent_kda_triton):
        o, ht = fn(q, k, v, g, beta, initial_state=h0.float(), output_final_state=True, use_qk_l2norm=True)
        assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
        assert ((o.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        assert ((ht - ref_ht).norm() / ref_ht.norm()).item() < 1e-2


def case_bf16_grads(device):
    """bf16 inputs: the Triton backward (fp32 accumulation) against the torch path on the same bf16 inputs."""
    inputs = _inputs(device, 100, 32, dtype=torch.bfloat16)
    inputs[5] = inputs[5].float()
    kw = dict(use_qk_l2norm=True, cu_seqlens=None)
    ref = run(kda_mod.chunk_kda_torch, inputs, **kw)
    out = _triton_env(lambda: run(kda_mod.chunk_kda, inputs, **kw))
    for name in NAMES:
        assert out[name].dtype == ref[name].dtype, name
        a, b = out[name].float(), ref[name].float()
        assert ((a - b).norm() / b.norm()).item() < 1e-2, name


def case_tiny_model(device):
    """Forward + backward of a tiny KimiTextForCausalLM: triton dispatch equals the torch path."""
    from tests.text.test_model import tiny_model

    ids = torch.randint(3, 61, (2, 80), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model = tiny_model().to(device).train()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), grads

    prev = os.environ.get("KIMI_VL_KERNELS")
    os.environ["KIMI_VL_KERNELS"] = "torch"
    try:
        logits_ref, grads_ref = step()
    finally:
        if prev is None:
            del os.environ["KIMI_VL_KERNELS"]
        else:
            os.environ["KIMI_VL_KERNELS"] = prev
    logits, grads = _triton_env(step)
    assert (logits - logits_ref).abs().max().item() < 1e-4
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert (g - grads_ref[name]).abs().max().item() < 1e-4, name


# ---------------------------------------------------------------------------------------------- tests


# Every length (one token, one whole chunk, a partial chunk, more than two chunks) with each head size twice in the
# default suite; the other four combinations, which the interpreter takes minutes over, are `slow`.
_COVERING = {(1, 16), (64, 32), (100, 16), (130, 32)}
SHAPES = [pytest.param(T, D, marks=() if (T, D) in _COVERING else pytest.mark.slow)
          for T in (1, 64, 100, 130) for D in (16, 32)]


@pytest.mark.parametrize(("T", "D"), SHAPES)
def test_recurrent_matches_torch(T, D):
    _run_case("case_recurrent", T=T, D=D, use_h0=T != 64, l2=T != 100)


def test_recurrent_varlen_matches_torch():
    _run_case("case_recurrent", T=130, D=16, use_h0=True, l2=True, varlen=True)


@pytest.mark.parametrize(("T", "D"), SHAPES)
def test_chunk_matches_torch_with_grads(T, D):
    _run_case("case_chunk", T=T, D=D, use_h0=T != 64, l2=T != 100)


@pytest.mark.parametrize("gate_div", [1.0, 10.0])
def test_chunk_varlen_three_sequences(gate_div):
    _run_case("case_chunk", T=130, D=32, use_h0=True, l2=True, gate_div=gate_div, varlen=True)


def test_chunk_hard_reset_gates_stay_finite():
    _run_case("case_chunk", T=100, D=16, use_h0=True, l2=True, varlen=True, hard_reset=True)


def test_chunk_infinite_gates_match_the_reference():
    _run_case("case_chunk_infinite_gates")


def test_chunk_odd_head_dims():
    _run_case("case_odd_dims")


def test_empty_time_axis():
    _run_case("case_empty_time_axis")


def test_bf16_inputs():
    _run_case("case_bf16")


def test_bf16_gradients():
    _run_case("case_bf16_grads")


def test_dispatch_uses_triton_when_forced():
    _run_case("case_triton_is_used")


def test_recurrent_with_grad_falls_back_to_torch():
    _run_case("case_recurrent_with_grad_falls_back")


def test_tiny_model_forward_backward_triton_equals_torch():
    _run_case("case_tiny_model")


@pytest.mark.slow
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_larger_shapes(varlen):
    _run_case("case_chunk", T=400, D=64, use_h0=True, l2=True, varlen=varlen)


def test_dispatch_defaults_and_bad_value(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("KIMI_VL_KERNELS", raising=False)
    assert kda_mod._backend(x) == "torch"
    for mode in ("reference", "torch", "triton", "TRITON"):
        monkeypatch.setenv("KIMI_VL_KERNELS", mode)
        assert kda_mod._backend(x) == mode.lower()
    monkeypatch.setenv("KIMI_VL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KIMI_VL_KERNELS"):
        kda_mod._backend(x)


def test_float64_with_triton_forced_uses_torch(monkeypatch):
    monkeypatch.setenv("KIMI_VL_KERNELS", "triton")
    inputs = make_inputs(B=1, T=10, H=2, Dk=16, Dv=16)
    out = run(kda_mod.chunk_kda, inputs)
    ref = run(kda_mod.naive_recurrent_kda, inputs)
    assert out["o"].dtype == torch.float64
    _assert_close(out, ref, tol=1e-10)
