"""Named choices of the params, each registered once where it is implemented.

A ``Registry`` maps the names a param accepts (``train.loss.loss_type: dapo``) to the objects that
implement them (a function, a class). Each registry lives in the module of its entries
(``grpo.algorithm.loss.AGGREGATIONS``, ``grpo.algorithm.entropy.TOKEN_RULES`` ...); an entry joins it with the
decorator where it is defined::

    @AGGREGATIONS.register("dapo")
    class TokenMean: ...

An entry may declare its own options as a small typed model, its ``Options`` attribute (a
``grpo.core.fields.Section``): they sit in the params under the entry's name
(``train.loss.entropy_rule_options.archer.clip_high``), validated by that model, their defaults its
own (``grpo.config.choices.EntryOptions``); the section keeps only what every run has.

``grpo.config.choices`` lists every registry by the param it serves; ``grpo.config.reading`` validates those
params against it, so the allowed values have this one home, and adding an entry touches its own
module (plus the params that choose it). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T]):
    """Names -> entries for the param ``param`` (``section.key``, used in messages); a read-only
    mapping, in registration order, that grows by ``register``.

    ``also``: names the param accepts that are not entries (``auto``: resolved by the caller).
    """

    def __init__(self, param: str, what: str, also: tuple[str, ...] = ()):
        self.param, self.what, self.also = param, what, also
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name``; a name taken by another
        object is a ``ValueError`` (two entries cannot answer to one name)."""

        def add(entry: T) -> T:
            if name in self.also or (name in self._entries and self._entries[name] is not entry):
                raise ValueError(f"{self.param}: {name!r} is already taken")
            self._entries[name] = entry
            return entry

        return add

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def accepted(self) -> tuple[str, ...]:
        """Every value the param accepts: the ``also`` names, then the registered ones."""
        return (*self.also, *self._entries)

    def options(self, name: str) -> type | None:
        """The options model entry ``name`` declares (its ``Options`` attribute, a
        ``grpo.core.fields.Section`` whose defaults are the entry's), or None: an entry without options,
        or a name that is not an entry."""
        return getattr(self._entries.get(name), "Options", None)

    def with_options(self) -> tuple[str, ...]:
        """The names of the entries that declare options, in registration order."""
        return tuple(n for n in self._entries if self.options(n) is not None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, name: str, entry: T) -> None:
        """Replace or add an entry without the taken-name check (pytest's ``monkeypatch.setitem``)."""
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def get(self, name: str, default=None):
        """The entry of ``name``, or ``default`` (``Mapping.get`` catches only ``KeyError``:
        pytest's ``monkeypatch.setitem`` reads the old entry through it)."""
        return self._entries.get(name, default)

    def __getitem__(self, name: str) -> T:
        """The entry of ``name``; ``ValueError`` naming the param and the known names otherwise."""
        if name not in self._entries:
            raise ValueError(f"{self.param}: no {self.what} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def check(self, name: str, param: str | None = None) -> str:
        """``name`` if the param accepts it, else ``ValueError`` of one line naming the param
        (``param``: another param served by this registry)."""
        if name not in self.accepted():
            raise ValueError(f"{param or self.param}: must be one of {', '.join(self.accepted())}; got {name!r}")
        return name

    @contextlib.contextmanager
    def registered(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered under ``name`` inside the block only (a plug-in tried in a test or
        a notebook)."""
        self.register(name)(entry)
        try:
            yield entry
        finally:
            del self._entries[name]
