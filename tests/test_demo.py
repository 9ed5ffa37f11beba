"""The demo (`python -m serveattn demo`) runs end to end and its attention matches the float64 oracle."""
import re

import pytest
import torch

from serveattn import demo


def _run(capsys, *args):
    rc = demo.main(["--steps", "2", "--batch", "2", "--seed", "1", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "prefill" in out and "decode" in out
    assert out.strip().splitlines()[-1] == "demo OK"
    return out


def test_demo_torch_cpu(capsys):
    out = _run(capsys, "--backend", "torch", "--device", "cpu")
    assert "kv-dtype" not in out and "vs bf16 cache" not in out  # the default demo serves one bf16 cache


def test_demo_triton(capsys):
    # On a CPU machine conftest sets TRITON_INTERPRET=1, so this runs the kernels through the interpreter.
    _run(capsys, "--backend", "triton", "--device", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("backend,kv_dtype", [("torch", "fp8_e4m3"), ("torch", "fp8_e5m2"), ("triton", "fp8_e4m3")])
def test_demo_fp8_cache(capsys, backend, kv_dtype):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    out = _run(capsys, "--backend", backend, "--device", device, "--kv-dtype", kv_dtype)
    assert f"kv-dtype={kv_dtype}" in out and "-- bf16 KV cache (baseline)" in out
    assert out.count("prefill ") == 2 and out.count("decode ") == 2  # the fp8 run and the bf16 run
    scales = [float(s) for s in re.findall(r"[kv] (\d\.\d+e[-+]\d+)", out.split("kv scales per layer:")[1].splitlines()[0])]
    assert len(scales) == 2 * demo.CPU_CONFIG.layers and all(0 < s < 1 for s in scales)
    logits = re.search(r"logits +max\|err\| (\S+) +rel err (\S+)", out)
    # an fp8 cache differs from the bf16 one (0 would mean the fp8 run never quantized), within the bound
    assert 0 < float(logits.group(2)) < demo.FP8_LOGITS_REL_TOL[kv_dtype]
    assert re.search(r"greedy tokens agree: \d/2 requests identical over 3 tokens", out)


def test_demo_rejects_unknown_kv_dtype(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--kv-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
