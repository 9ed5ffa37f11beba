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
