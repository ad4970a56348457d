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
