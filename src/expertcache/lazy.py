"""A registry whose entries are imported on first use: names are known at once, modules load later."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Mapping[str, T], Generic[T]):
    """A mapping of names to ``"package.module:Attribute"`` paths, each resolved (imported) the first
    time it is looked up; iteration and membership never import anything. ``register`` adds an object."""

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

    def register(self, name: str, obj: T) -> None:
        """Add (or replace) an entry by the object itself (``plugins``: a class of the user's own)."""
        self._paths[name] = f"{obj.__module__}:{obj.__qualname__}"
        self._loaded[name] = obj

    def path(self, name: str) -> str:
        """Where the entry lives (``module:Attribute``), without importing it."""
        return self._paths[name]


def hqq_quantizer():
    """hqq's ``Quantizer``, the quantised miss path's and ``expertcache quantize``'s library. It is an
    optional dependency (``pip install 'expertcache[quant]'``): when installed, transformers imports it
    with every model (its quantised KV cache), and its ``torch.compile`` decorators pull in TorchDynamo
    and Inductor, about 1.2 s of every start on this project's CI machine (the engine defers that import:
    ``defer_transformers_hqq``)."""
    try:
        from hqq.core.quantize import Quantizer
    except ImportError:
        from expertcache.errors import ExpertcacheError

        raise ExpertcacheError(
            "int2 copies of the experts need the optional hqq package: pip install 'expertcache[quant]'"
        ) from None
    return Quantizer


class _DeferredHqqQuantizer:
    """Stands for hqq's ``Quantizer`` in transformers' ``cache_utils`` (its quantised KV cache reads
    ``quantize``, ``dequantize`` and ``cuda`` off it): hqq is imported at the first such read."""

    def __getattr__(self, name: str):
        return getattr(hqq_quantizer(), name)


def defer_transformers_hqq() -> None:
    """Import transformers' ``cache_utils`` without its import of hqq, when hqq is installed.

    ``cache_utils`` imports hqq at its own import, for ``HQQQuantizedCache`` (a quantised KV cache the
    engine never uses), and hqq's ``torch.compile`` decorators pull in TorchDynamo and Inductor: 0.7-0.8 s
    of every start of the engine on the development VM (``import expertcache.engine`` 4.5 s against
    3.7 s, medians of 5). Here ``cache_utils`` is imported while transformers' ``is_hqq_available`` says
    no, then given back the real check, with a stand-in for hqq's ``Quantizer`` that imports it when that
    cache first uses it. Nothing is done when ``cache_utils`` is already imported, hqq is not installed,
    or transformers no longer has these names."""
    if "transformers.cache_utils" in sys.modules:
        return
    try:
        import transformers.utils as tu

        real = tu.is_hqq_available
        if not real():
            return
    except (ImportError, AttributeError):
        return

    def no(*args, **kwargs) -> bool:
        return False

    tu.is_hqq_available = no
    try:
        import transformers.cache_utils as cu
    except ImportError:
        return
    finally:
        tu.is_hqq_available = real
        for name, module in list(sys.modules.items()):  # every module that took the stand-in back
            if name.startswith("transformers") and getattr(module, "is_hqq_available", None) is no:
                module.is_hqq_available = real
    if not hasattr(cu, "HQQQuantizer"):
        cu.HQQQuantizer = _DeferredHqqQuantizer()
