"""Keeps the differential fuzzer (scripts/fuzz.py) alive in CI: a fixed handful of seeds per family, each a
random configuration of the public API checked against the float64 reference (see the script's docstring)."""
import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "fuzz.py")
_spec = importlib.util.spec_from_file_location("serveattn_fuzz", _PATH)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # its dataclasses look their module up there
_spec.loader.exec_module(fuzz)

SEEDS_PER_FAMILY = 10


@pytest.mark.parametrize("seed", range(SEEDS_PER_FAMILY))
@pytest.mark.parametrize("family", fuzz.FAMILIES)
def test_fuzz_seed(family, seed):
    case = fuzz.run_case(family, seed)
    assert not case.failures, f"{case.failures[0]}\nconfig: {fuzz.short(case.config)}\nrepro: {case.repro()}"
    unexpected = [msg for expected, msg in case.refusals if not expected]
    assert not unexpected, unexpected


def test_a_seed_is_one_configuration():
    """The reproducer line is worth something only if a seed always draws the same case."""
    a, b = fuzz.run_case("decode", 3), fuzz.run_case("decode", 3)
    assert a.config == b.config and a.config


@pytest.mark.parametrize("family", ["prefill", "decode", "cascade"])
def test_the_checks_bite(family, monkeypatch):
    """A reference that is off by 1% must fail every family's first seeds: the fuzzer's checks are not vacuous."""
    real = fuzz.reference.attention

    def off(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.01, lse
    monkeypatch.setattr(fuzz.reference, "attention", off)
    cases = [fuzz.run_case(family, seed, recycle=False) for seed in range(6)]
    assert any(c.failures for c in cases)


def test_alone_check_is_bitwise_where_the_tiles_agree():
    """Decode seed 1601700 (tree verify on the tensor-core route): request 0 alone plans BLOCK_M 32, the batch 64;
    under the interpreter the two differ in the last bit of one LSE (numpy's float32 matmul rows depend on the row
    count), so the check falls back to closeness there, and says so in the case's configuration."""
    case = fuzz.run_case("decode", 1601700, recycle=False)
    assert not case.failures, case.failures
    assert case.config["alone_tiles"] == ((64, 32, 4), (32, 32, 4))
