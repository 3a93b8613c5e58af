"""Backends turn a GraphView into a Program: a callable taking the graph's
inputs at the positions `program.slots` and returning the output tensors."""
from __future__ import annotations

import os

from fastlazy.backends.base import Backend, Program
from fastlazy.backends.eager import EagerBackend
from fastlazy.backends.inductor import InductorBackend
from fastlazy.backends.native import NativeBackend
from fastlazy.backends.torchscript import TorchScriptBackend

_REGISTRY = {"torchscript": TorchScriptBackend, "inductor": InductorBackend,
             "native": NativeBackend, "eager": EagerBackend}
_instances: dict[str, Backend] = {}


def names():
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown fastlazy backend {name!r}; choose one of "
                         f"{', '.join(_REGISTRY)}")
    if name not in _instances:
        _instances[name] = _REGISTRY[name]()
    return _instances[name]


def default_name() -> str:
    return os.environ.get("FASTLAZY_BACKEND", "auto")


__all__ = ["Backend", "Program", "get", "names", "default_name"]
