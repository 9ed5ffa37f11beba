"""Which refusals does the CPU suite never raise? Runs the test suite with every `policy.refuse` /
`policy.unsupported` call recorded, then lists the call sites in serveattn/ that no test reached (each refusal
must be tested: its exception type and a match on its sentence).

    python scripts/refusal_audit.py                 # the whole CPU suite (-n 2, ~7 min), then the report
    python scripts/refusal_audit.py tests/test_page.py   # pytest arguments instead of the whole suite

Not counted: refusals raised only in processes the tests spawn (test_distributed's ranks) and in GPU-only tests
when run without a GPU. As a pytest plugin (`-p refusal_audit`, scripts/ on PYTHONPATH) it writes the sites it
saw to $REFUSAL_AUDIT_DIR/hits-<worker>.txt."""
import ast
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
_hits = set()


def pytest_configure(config):
    """Wraps the two refusal functions (every entry point calls them through the policy module)."""
    from serveattn import policy

    refuse, unsupported = policy.refuse, policy.unsupported

    def record():
        caller = sys._getframe(2)
        _hits.add((os.path.relpath(caller.f_code.co_filename, ROOT), caller.f_lineno))

    def recorded_refuse(entry, message):
        record()
        refuse(entry, message)

    def recorded_unsupported(entry, message):
        record()
        unsupported(entry, message)

    policy.refuse, policy.unsupported = recorded_refuse, recorded_unsupported


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("REFUSAL_AUDIT_DIR")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"hits-{worker}.txt"), "w") as fh:
            fh.writelines(f"{path}:{line}\n" for path, line in sorted(_hits))


def call_sites():
    """(path, first line, last line, source line) of every refuse / unsupported call in serveattn/."""
    sites = []
    for path in sorted((ROOT / "serveattn").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and len(node.args) >= 2:
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("refuse", "unsupported"):
                    sites.append((str(path.relative_to(ROOT)), node.lineno, node.end_lineno,
                                  lines[node.lineno - 1].strip()))
    return sorted(sites)


def main():
    args = sys.argv[1:] or ["-n", "2", "tests"]
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, REFUSAL_AUDIT_DIR=folder,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")])))
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "refusal_audit", "-p", "no:cacheprovider",
                              *args], cwd=ROOT, env=env)
        hits = set()
        for name in os.listdir(folder):
            for line in open(os.path.join(folder, name)):
                path, _, number = line.strip().rpartition(":")
                hits.add((path, int(number)))
    sites = call_sites()
    missed = [s for s in sites if not any(p == s[0] and s[1] <= n <= s[2] for p, n in hits)]
    print(f"\n{len(sites)} refusal call sites in serveattn/; {len(sites) - len(missed)} raised by these tests, "
          f"{len(missed)} not (pytest exit {rc}):")
    for path, line, _, source in missed:
        print(f"  {path}:{line}: {source[:110]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
