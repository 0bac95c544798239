"""A parameter the root's forward reads from a module itself, outside
every forward that gathers its unit: the module's class becomes a
subclass of the same name whose __getattr__ reports the read."""
import weakref


# module -> {attribute: (weak ShardedModule, unit)}: the parameters whose
# read _Watched reports; weak, so a module dropped is forgotten
_WATCH = weakref.WeakKeyDictionary()
_WATCHED = {}  # module class -> its _Watched subclass


def _watch(module, attr, sm, u):
    """Reports reads of module.attr (a parameter of unit u) to sm._read: the
    module's class becomes a subclass of it (same name, so repr and
    isinstance stay; FSDP2's fully_shard swaps the class likewise) whose
    __getattr__ -- the lookup nn.Module answers parameters with --
    reports the read first."""
    base = type(module)
    if base not in _WATCHED.values():
        cls = _WATCHED.get(base)
        if cls is None:
            cls = _WATCHED[base] = _watched_class(base)
        module.__class__ = cls
    _WATCH.setdefault(module, {})[attr] = (weakref.ref(sm), u)


def _watched_class(base):
    def __getattr__(self, name):
        got = _WATCH.get(self, {}).get(name)
        if got is not None:
            sm = got[0]()
            if sm is not None:
                sm._read(got[1], self, name)
        return base.__getattr__(self, name)

    def __reduce_ex__(self, protocol):
        # pickled and copied as the class it was built as
        cls = type(self)
        self.__class__ = base
        try:
            return self.__reduce_ex__(protocol)
        finally:
            self.__class__ = cls

    return type(base.__name__, (base,), {
        "__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__,
        "__module__": base.__module__, "__qualname__": base.__qualname__})
