"""scripts/gpu_run.sh on a machine without a GPU: every step name is checked before any step runs, against the step
functions the script defines, so a misspelt or missing step costs no device call's other steps."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_run.sh")


def test_unknown_step_stops_before_any_step(tmp_path):
    run = subprocess.run(["bash", SCRIPT, "env", "no-such-step"], capture_output=True, text=True,
                         env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert run.returncode == 2
    assert "unknown step 'no-such-step'" in run.stderr
    assert not (tmp_path / "env.txt").exists()  # env, listed first, did not run
    listed = set(run.stderr.split("steps are:")[1].split())
    defined = {name.replace("_", "-") for name in re.findall(r"^step_(\w+)\(\)", open(SCRIPT).read(), re.M)}
    assert defined - {"bench"} <= listed and "bench" not in listed


def _junit(tmp_path, failures):
    cases = "".join(f'<testcase classname="tests.test_x" name="test_{i}[a-b]">'
                    + (f'<failure message="{m}">trace</failure>' if m else "") + "</testcase>"
                    for i, m in enumerate(failures))
    path = tmp_path / "junit.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    done = subprocess.run(["python3", os.path.join(ROOT, "scripts", "oom_failures.py"), str(path)],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.split(), done.returncode


def test_tests_step_reruns_only_out_of_memory_failures(tmp_path):
    """scripts/oom_failures.py, which the tests step asks: the ids of failures that ran out of CUDA memory (an
    H100's 78 GiB under 16 workers) are rerun; exit status 1 says other failures stand whatever the rerun gives."""
    oom = "torch.OutOfMemoryError: CUDA out of memory"
    assert _junit(tmp_path, [oom, None, oom]) == (["tests/test_x.py::test_0[a-b]", "tests/test_x.py::test_2[a-b]"], 0)
    assert _junit(tmp_path, [oom, "AssertionError: assert 0 > 0"]) == (["tests/test_x.py::test_0[a-b]"], 1)
    assert _junit(tmp_path, ["AssertionError: assert 0 > 0"]) == ([], 1)
    assert _junit(tmp_path, [None, None]) == ([], 0)
