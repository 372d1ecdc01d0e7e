"""Frozen structs (printable, comparable, serialisable), for modules on the hook's start path.

dataclasses would do, but importing it (it imports inspect) would cost a cold start 17 ms
(docs/performance.md) and decorating each class ~0.3 ms: together more than the rest of a GPU
container's hook run. A Frozen subclass names its fields in __slots__, may give defaults in
_defaults, and gets keyword or positional construction, immutability, ==, hash, repr and
to_json() for the cost of a class statement.
"""

_set = object.__setattr__  # past the frozen __setattr__


class Frozen:
    __slots__ = ()
    _defaults: dict = {}
    _fields: tuple = ()

    def __init_subclass__(cls, **kwargs):
        # Once per class, not on every construction, ==, hash and repr: a GPU start builds hundreds.
        super().__init_subclass__(**kwargs)
        names = []
        for klass in reversed(cls.__mro__):
            names.extend(klass.__dict__.get("__slots__", ()))
        cls._fields = tuple(names)

    @classmethod
    def fields(cls) -> tuple:
        return cls._fields

    def __init__(self, *args, **kwargs):
        # The positional values first, then only the remaining fields are looked up: a GPU start
        # builds hundreds of them (the inventory, the plan), and this takes 25 to 45% less
        # time per struct than merging everything into one dict first.
        fields = self._fields
        given = len(args)
        if given > len(fields):
            raise TypeError(f"{type(self).__name__} takes {len(fields)} values, got {given}")
        for name, value in zip(fields, args):
            _set(self, name, value)
        if given < len(fields) or kwargs:
            defaults = self._defaults
            for name in fields[given:]:
                if name in kwargs:
                    _set(self, name, kwargs.pop(name))
                elif name in defaults:
                    _set(self, name, defaults[name])
                else:
                    raise TypeError(f"{type(self).__name__}: missing field {name!r}")
            if kwargs:  # a name that is no field, or one already given by position
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {next(iter(kwargs))!r}")

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.fields())

    def __eq__(self, other):
        return type(self) is type(other) and self._values() == other._values()

    def __hash__(self):
        return hash((type(self), self._values()))

    def __repr__(self):
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.fields())
        return f"{type(self).__name__}({inner})"

    def replace(self, **changes):
        values = {name: getattr(self, name) for name in self.fields()}
        values.update(changes)
        return type(self)(**values)

    def to_json(self) -> dict:
        return {name: to_json(getattr(self, name)) for name in self.fields()}


def to_json(value):
    """Plain JSON-able data from Frozen structs, tuples, lists, sets and dicts."""
    if isinstance(value, Frozen):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_json(v) for v in value)
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value
