"""A torch function made to answer with ours, keeping its identity (a
name bound to it before, ``from torch.nn.utils import clip_grad_norm_``,
and torch's own callers reach ours too): clip_hook.py and inits.py."""
import functools
import types


def reroute(module, name, make_ours):
    """module.<name> (a torch function) answers with make_ours(torch_fn),
    torch_fn a copy of torch's function that ours calls for what is not
    ours. Its code becomes a call of ours, looked up in its module's
    globals (a function's code runs with them); one holding a closure (a
    decorator of torch's) cannot take another code, and is replaced as
    the module's attribute instead."""
    fn = getattr(module, name, None)
    if not isinstance(fn, types.FunctionType):
        return
    torch_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                                  fn.__defaults__, fn.__closure__)
    torch_fn.__kwdefaults__ = fn.__kwdefaults__
    torch_fn.__dict__.update(fn.__dict__)
    ours = make_ours(torch_fn)
    if fn.__closure__:
        setattr(module, name, functools.wraps(fn)(lambda *a, **k: ours(*a, **k)))
        return
    key = "_shardd_" + name
    fn.__globals__[key] = ours
    scope = {}
    exec("def trampoline(*args, **kwargs):\n"
         "    return %s(*args, **kwargs)\n" % key, {}, scope)
    fn.__code__ = scope["trampoline"].__code__
    fn.__defaults__ = fn.__kwdefaults__ = None
    fn.__wrapped__ = torch_fn  # inspect.signature: torch's
