"""Frozen, printable, comparable, serialisable records, for modules on the hook's start path.

dataclasses would do, but importing it (it imports inspect) costs ~10 ms here and decorating each
class ~0.3 ms: together more than the rest of a GPU container's hook run. A Record subclass
names its fields in __slots__, may give defaults in _defaults, and gets keyword or positional
construction, immutability, ==, hash, repr and to_json() for the cost of a class statement.
"""


class Record:
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
        fields = self.fields()
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes {len(fields)} values, got {len(args)}")
        values = dict(zip(fields, args))
        for name, value in kwargs.items():
            if name not in fields or name in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {name!r}")
            values[name] = value
        for name in fields:
            if name in values:
                value = values[name]
            elif name in self._defaults:
                value = self._defaults[name]
            else:
                raise TypeError(f"{type(self).__name__}: missing field {name!r}")
            object.__setattr__(self, name, value)

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
    """Plain JSON-able data from records, tuples, lists, sets and dicts."""
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_json(v) for v in value)
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value
