"""Transient areas, two forwards before one backward: a later forward's
use of a unit computes with leaf tensors of its own over the gathered
values, put into the unit's modules in the parameters' place while its
forward runs (hooks.py's _leaf / _swap_in), so that autograd accumulates
each forward's gradient on its own node. Code there (the module's
forward, a forward hook of the script's) takes them for the parameters,
so each leaf stands for its parameter as torch's would be the same
object in every forward:

* its ``.grad``, read or assigned while it is in its modules, is the
  parameter's (what the first forward's code sees there: its part of the
  reduced gradient), so a hook that adds to ``p.grad`` in place in each
  forward adds in each one, as in torch (the leaf's own, None until its
  backward, took the later forwards' additions nowhere, without a word);
  autograd's engine accumulates into the leaf's own ``.grad`` (C++, not
  this property), which the wrapper points at the gradient area;
* an attribute the script set on the parameter (``p.calls``,
  ``p._ema``) is read from the parameter, and one set on the leaf is
  set on the parameter (the leaf had none of them: an AttributeError, or
  a write lost with the leaf);
* it is an ``nn.Parameter``, as the parameter is (``isinstance`` checks
  in the script's code).

What it does not stand for: identity (``p is model.fc.weight`` taken in
another forward) and its C-level state (``requires_grad``, ``data``),
which are its own."""
import torch
from torch import nn

# torch's own .grad (the C getset), for the leaf's own gradient
_GRAD = torch._C._TensorBase.grad

# the leaf's own attributes (in its __dict__, never the parameter's)
_OWN = ("_shardd_of", "_shardd_in")


class _Leaf(nn.Parameter):
    """A later forward's leaf for one parameter (see the module
    docstring). _shardd_of: the parameter; _shardd_in: whether it is in
    its modules now (its .grad the parameter's)."""

    def __new__(cls, data, param):
        t = torch.Tensor._make_subclass(cls, data, True)
        d = t.__dict__
        d["_shardd_of"] = param
        d["_shardd_in"] = False
        return t

    @property
    def grad(self):
        if self.__dict__.get("_shardd_in"):
            return self.__dict__["_shardd_of"].grad
        return _GRAD.__get__(self)

    @grad.setter
    def grad(self, value):
        if self.__dict__.get("_shardd_in"):
            self.__dict__["_shardd_of"].grad = value
        else:
            _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self):
        self.grad = None

    def __getattr__(self, name):
        # only what the leaf itself lacks: the script's attributes of the
        # parameter (its instance dict), nothing of its class
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        p = self.__dict__.get("_shardd_of")
        if p is not None and name in p.__dict__:
            return p.__dict__[name]
        raise AttributeError("'%s' object has no attribute '%s'" % (
            type(p).__name__ if p is not None else "Tensor", name))

    def __setattr__(self, name, value):
        p = self.__dict__.get("_shardd_of")
        if p is None or name in _OWN or hasattr(type(self), name):
            object.__setattr__(self, name, value)  # torch's (data, requires_grad, ...)
        else:
            setattr(p, name, value)

    def __delattr__(self, name):
        p = self.__dict__.get("_shardd_of")
        if p is None or name in _OWN or hasattr(type(self), name):
            object.__delattr__(self, name)
        else:
            delattr(p, name)

    def __deepcopy__(self, memo):
        # nn.Parameter's makes type(self)(data, requires_grad)
        return nn.Parameter(self.detach().clone(), self.requires_grad)

    def __reduce_ex__(self, proto):
        # a copy or pickle of it (a state dict taken inside a forward) is
        # the parameter's values, as a plain tensor would be
        return torch.Tensor.__reduce_ex__(self.detach(), proto)

    def __repr__(self):
        return "Parameter containing:\n" + repr(self.detach())


def make_leaf(data, param):
    """A leaf over data (detached: it shares data's storage) standing for
    param."""
    return _Leaf(data.detach(), param)


def put_in(leaf, inside):
    """leaf is in its modules (inside True) or out of them: its .grad the
    parameter's or its own."""
    leaf.__dict__["_shardd_in"] = inside
