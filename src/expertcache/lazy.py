"""A registry whose entries are imported on first use: names are known at once, modules load later."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Mapping[str, T], Generic[T]):
    """A read-only mapping of names to ``"package.module:Attribute"`` paths, each resolved (imported)
    the first time it is looked up; iteration and membership never import anything."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, T] = {}

    def __getitem__(self, name: str) -> T:
        if name not in self._loaded:
            module, _, attr = self._paths[name].partition(":")  # KeyError for unknown names
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def path(self, name: str) -> str:
        """Where the entry lives (``module:Attribute``), without importing it."""
        return self._paths[name]


def hqq_quantizer():
    """hqq's ``Quantizer``, the quantised miss path's and ``expertcache quantize``'s library. It is an
    optional dependency (``pip install 'expertcache[quant]'``): when installed, transformers imports it
    with every model (its quantised KV cache), and its ``torch.compile`` decorators pull in TorchDynamo
    and Inductor, about 1.2 s of every start on this project's CI machine."""
    try:
        from hqq.core.quantize import Quantizer
    except ImportError:
        from expertcache.errors import ExpertcacheError

        raise ExpertcacheError(
            "quantised experts need the optional hqq package: pip install 'expertcache[quant]'"
        ) from None
    return Quantizer
