"""Environment switches (SERVEATTN_*, TRITON_INTERPRET) read on the per-call paths, cheaply.

`os.environ.get` of an unset name raises and catches a KeyError inside `Mapping.get`: ~1.3 us a read on a
development CPU, several on the H200's host, and an eager prefill run() read five such switches. `get` reads the
dict behind `os.environ` instead (CPython keeps it in step with every `os.environ[...] = ` and `del`, pytest's
monkeypatch included), and falls back to `os.environ.get` where that dict is not there. Switches read once at import
stay plain `os.environ.get`.
"""
from __future__ import annotations

import os

_KEYS: dict = {}  # a name -> its key in os.environ's dict; a tuple of names (snapshot) -> their keys


def get(name: str, default: str) -> str:
    """os.environ.get(name, default)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data.__class__ is not dict:
        return environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = environ.encodekey(name)
    value = data.get(key)
    return default if value is None else environ.decodevalue(value)


def snapshot(names: tuple) -> tuple:
    """The values of names as os.environ holds them (None where unset), to compare with a later snapshot."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data.__class__ is not dict:
        return tuple([environ.get(name) for name in names])
    keys = _KEYS.get(names)
    if keys is None:
        keys = _KEYS[names] = tuple(map(environ.encodekey, names))
    return tuple([data.get(key) for key in keys])
