"""Name -> factory registries, so configs pick components by name (no if/elif chains)."""
from __future__ import annotations

from typing import Callable, Dict, Generic, Iterable, TypeVar

from fedbench.errors import FedbenchError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            for n in (name, *aliases):
                if n in self._items:
                    raise RuntimeError(f"{self.kind} '{n}' registered twice")
                self._items[n] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise FedbenchError(
                f"unknown {self.kind} '{name}'; choose one of: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> Iterable[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
