"""The warp-specialized Hopper prefill kernel on a machine without a GPU: it compiles for sm_90 (Gluon is not
interpreted, so this is what CPU CI can hold it to), and calls it does not serve go to prefill_kernel."""
import os
import re
import subprocess
import sys

import pytest
import torch

from serveattn.kernels import attention_ws as ws

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kernel", ["prefill-ws", "prefill-ws-cp"])
def test_compiles_for_sm90_with_the_designed_schedule(kernel, tmp_path):
    """Compiled in a fresh process (the suite runs under TRITON_INTERPRET=1, which Gluon does not take)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_probe.py"), "--kernel", kernel,
                          "--cp", "4,40,232", "--dump", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = (tmp_path / f"{kernel}.ptx").read_text()
    # two consumer groups, each: S(0) before the loop, S(j+1) and P.V(j) in it (x head_dim / 16 k-steps)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * 3 * (ws.HEAD_DIM.value // 16)
    if kernel == "prefill-ws":
        assert "cp.async.bulk.tensor" in ptx  # the producer's TMA
    else:  # a producer warp group's cp.async, each thread arriving on the stage's barrier
        assert "cp.async.mbarrier.arrive.noinc" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # S(j+1) stays in flight over softmax(j)
    producer_regs = str(ws.PRODUCER_REGS.value) if kernel == "prefill-ws" else "40"
    assert producer_regs in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)


def test_not_served_off_the_gpu():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert ws.serves(q, q, q, plan=None, descales=None) is False
