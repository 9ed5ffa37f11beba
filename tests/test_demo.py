"""The demo (`python -m serveattn demo`) runs end to end and its attention matches the float64 oracle."""
import torch

from serveattn import demo


def _run(capsys, *args):
    rc = demo.main(["--steps", "2", "--batch", "2", "--seed", "1", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "prefill" in out and "decode" in out
    assert out.strip().splitlines()[-1] == "demo OK"


def test_demo_torch_cpu(capsys):
    _run(capsys, "--backend", "torch", "--device", "cpu")


def test_demo_triton(capsys):
    # On a CPU machine conftest sets TRITON_INTERPRET=1, so this runs the kernels through the interpreter.
    _run(capsys, "--backend", "triton", "--device", "cuda" if torch.cuda.is_available() else "cpu")
