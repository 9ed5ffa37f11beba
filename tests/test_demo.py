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
    layers = (demo.CUDA_CONFIG if device == "cuda" else demo.CPU_CONFIG).layers
    assert len(scales) == 2 * layers and all(0 < s < 1 for s in scales)
    logits = re.search(r"logits +max\|err\| (\S+) +rel err (\S+)", out)
    # an fp8 cache differs from the bf16 one (0 would mean the fp8 run never quantized), within the bound
    assert 0 < float(logits.group(2)) < demo.FP8_LOGITS_REL_TOL[kv_dtype]
    assert re.search(r"greedy tokens agree: \d/2 requests identical over 3 tokens", out)


def test_demo_rejects_unknown_kv_dtype(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--kv-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


# ---------------------------------------------------------------- --speculative
# Seed 4 with a draft noise of 0.1: greedy acceptance well inside (0, 1) in both modes, and some of the tree's
# accepted paths leave its first branch (so the accepted nodes' K/V are moved down in the target's cache).
SPEC_ARGS = ["--speculative", "--steps", "8", "--batch", "2", "--seed", "4", "--draft-noise", "0.1"]


def _run_spec(capsys, *args, rc=0):
    code = demo.main([*SPEC_ARGS, *args])
    out = capsys.readouterr().out
    assert code == rc, out
    return out


def _greedy_checked(out, mode, device="cpu"):
    """The greedy run of `mode` equals non-speculative greedy decoding; returns (acceptance, side paths).
    On CUDA (a bf16 model) a request may also differ after a near-tie of the logits, which the demo reports."""
    m = re.search(rf"^{mode} greedy: greedy tokens equal non-speculative greedy decoding: (\d)/2 requests "
                  rf"identical over 9 tokens(?: \((\d) differ after a near-tie\))?$", out, re.M)
    assert m, out
    identical, ties = int(m.group(1)), int(m.group(2) or 0)
    assert identical == 2 if device == "cpu" else identical + ties == 2, out
    m = re.search(rf"^{mode} greedy acceptance (\S+) \((\d+)/(\d+) draft tokens", out, re.M)
    rate, accepted, proposed = float(m.group(1)), int(m.group(2)), int(m.group(3))
    assert proposed > 0 and rate == pytest.approx(accepted / proposed, abs=1e-3)
    side = re.search(rf"^{mode} greedy acceptance .*; (\d+) accepted paths through another branch", out, re.M)
    return rate, int(side.group(1)) if side else None


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_demo_speculative_torch(capsys, mode):
    out = _run_spec(capsys, "--backend", "torch", "--device", "cpu", "--spec-mode", mode)
    assert out.strip().splitlines()[-1] == "demo OK"
    rate, side = _greedy_checked(out, mode)
    assert 0 < rate < 1
    if mode == "tree":
        assert side > 0  # compaction exercised
        assert "decode wrapper, tree_parents" in out
    else:
        assert "q_len_per_req=5" in out
    # the sampled run (temperature 1, through the speculative samplers) follows the greedy one
    m = re.search(rf"^{mode} T=1 acceptance (\S+)", out, re.M)
    assert m and 0 <= float(m.group(1)) <= 1
    assert sum(line.startswith("verify ") for line in out.splitlines()) == 2 and "demo FAILED" not in out


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_demo_speculative_triton(capsys, mode):
    # Through the interpreter on a CPU machine (conftest sets TRITON_INTERPRET=1); the greedy run only.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = _run_spec(capsys, "--backend", "triton", "--device", device, "--spec-mode", mode, "--temperature", "0")
    assert out.strip().splitlines()[-1] == "demo OK"
    rate, side = _greedy_checked(out, mode, device)
    assert 0 < rate < 1
    assert mode == "chain" or side > 0 or device == "cuda"  # measured on the CPU config
    assert "[triton]" in out and "T=1" not in out and "[torch]" not in out


def test_demo_speculative_identical_draft_accepts_everything(capsys):
    out = _run_spec(capsys, "--backend", "torch", "--device", "cpu", "--spec-mode", "chain", "--temperature", "0",
                    "--draft-noise", "0")
    rate, _ = _greedy_checked(out, "chain")
    assert rate > 0.9  # the draft is the target: only rounding between row layouts could reject a token


def test_demo_speculative_fails_on_a_wrong_cache(capsys, monkeypatch):
    # Without the compaction of the accepted tree path, later tokens attend to stale K/V: the greedy check fails.
    monkeypatch.setattr(demo.PagedKV, "move", lambda self, i, src, dst: None)
    out = _run_spec(capsys, "--backend", "torch", "--device", "cpu", "--spec-mode", "tree", "--temperature", "0",
                    rc=1)
    assert "differs from non-speculative greedy decoding" in out and "demo FAILED" in out


def test_demo_speculative_refuses_fp8(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--speculative", "--kv-dtype", "fp8_e4m3"])
    assert "--speculative serves a bf16 KV cache" in capsys.readouterr().err
