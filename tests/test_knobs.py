"""serveattn.knobs.get is os.environ.get, for set, unset, changed and deleted names (monkeypatch's way and os's)."""
import os
import pathlib
import re

import pytest

from serveattn import knobs

NAME = "SERVEATTN_TEST_KNOB_X"


@pytest.mark.parametrize("default", ["1", "", "0"])
def test_follows_os_environ(monkeypatch, default):
    monkeypatch.delenv(NAME, raising=False)
    assert knobs.get(NAME, default) == os.environ.get(NAME, default) == default
    monkeypatch.setenv(NAME, "0")
    assert knobs.get(NAME, default) == "0"
    monkeypatch.setenv(NAME, "force,é")
    assert knobs.get(NAME, default) == os.environ.get(NAME, default) == "force,é"
    monkeypatch.delenv(NAME)
    assert knobs.get(NAME, default) == default
    os.environ[NAME] = "2"
    try:
        assert knobs.get(NAME, default) == "2"
    finally:
        del os.environ[NAME]
    assert knobs.get(NAME, default) == default


def test_without_the_dict_it_asks_os_environ(monkeypatch):
    class Plain(dict):  # no _data: the fallback
        pass
    monkeypatch.setattr(os, "environ", Plain({NAME: "7"}))
    assert knobs.get(NAME, "1") == "7" and knobs.get(NAME + "_UNSET", "1") == "1"


def test_per_call_paths_read_switches_through_knobs():
    """Every os.environ.get left in the package runs once at import (a module-level constant), or in bench/:
    run() and plan() paths read switches through knobs.get."""
    root = pathlib.Path(__file__).resolve().parent.parent / "serveattn"
    inside_functions = []
    for path in root.rglob("*.py"):
        if "bench" in path.parts or path.name == "knobs.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.(environ\.get|getenv)\(", line) and line[:1].isspace():
                inside_functions.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not inside_functions, "\n".join(inside_functions)
