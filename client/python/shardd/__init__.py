"""shardd — Python binding of libshardd (ctypes, no compiled extension).

    import shardd
    with shardd.Client(socket, job="run-1", rank=r, world=4,
                       reshard_after_forward=False) as c:  # resident areas
        buf = c.register_buffer("layer0.flat", "fp32", numel)
        buf.shard[:] = my_slice            # numpy view of this rank's shard
        c.gather(buf)                      # collective
        full = buf.gather                  # numpy view: the whole flat buffer
        buf.grad[:] = my_full_gradient     # numpy view of this rank's grad area
        c.scatter(buf, "mean")             # collective
        opt = c.register_optimizer("adamw", [buf], lr=1e-3)
        res = c.step(opt)                  # collective; res.step, res.total_norm

Every mapped area is exposed without copying as a numpy array (``buf.shard``,
``buf.gather``, ``buf.grad``, ``buf.reduced``), as a ``memoryview``
(``buf.memoryview("shard")``) and, when torch is importable, as a
``torch.Tensor`` (``buf.shard_tensor`` ... or ``buf.tensor("shard")``). They
alias memory that libshardd maps and unmaps: they are valid until the buffer
is unregistered on this client or the client is closed; touching one after
that is a use-after-unmap (a crash). bf16 areas are uint16 in numpy (numpy has
no bfloat16) and torch.bfloat16 in torch.

Transient areas (the default, FSDP's FULL_SHARD reshard; resident areas
need ``reshard_after_forward=False``, as the example above): a
buffer's block holds only the shard and the reduced-gradient shard
(``buf.transient``); ``buf.gather``/``buf.grad`` and their tensors are not
available (they raise E_STATE). Instead each gather leases this rank's areas
from its device's pool, mapped once per client:

    g, gr = c.gather_area(buf, want_grad=True)  # tensors over the leased areas
    ... forward with g, write the full gradient into gr ...
    c.scatter(buf, "mean")                      # consumes (returns) gr
    c.release(buf)                              # returns g

``g`` is valid until ``release(buf)``, ``gr`` until the scatter that consumes
it; after that the daemon may lease the memory to another buffer (the tensors
stay mapped, so a late use reads another buffer's data rather than crashing).
A rank holds at most 2 gather and 2 gradient areas at once; a third gather is
refused with E_LIMIT naming what it holds.

On the cuda backend (``buf.is_device``) the areas are the daemon's GPU memory
(CUDA IPC, opened by libshardd on GPU ``buf.device``): ``buf.tensor(area)`` is
a torch CUDA tensor over it (no copy, through ``__cuda_array_interface__``),
while numpy and memoryview views are refused (E_NO_CUDA). Once this client
has handed out such tensors, every gather, scatter and step it requests (and
unregister and close) first waits for the process's queued GPU work on their
GPUs (``torch.cuda.synchronize``), so the daemon reads finished data and
overwrites nothing a kernel still reads.

Failures raise :class:`shardd.Error` with ``code`` (int), ``code_name``
("E_NOT_OWNED") and ``message`` (the daemon's message when it sent one).

The nn.Module helper (use_orig_params model) is :mod:`shardd.nn`; a daemon
launcher for tests and examples is :mod:`shardd.daemon`.
"""
# The binding lives in client.py (Client), objects.py (Buffer, View,
# Optimizer) and _convert.py (names, counts, dtypes, Error); this module
# names all of it shardd.X, as it always did: every name it had before the
# split is imported here, private ones and modules included (callers and
# tests reach shardd._lib, shardd._CudaArea, ...).
# flake8: noqa: F401
import collections
import ctypes
import json as _json
import math
import os
import warnings

from . import _lib as L
from ._convert import (ALL_REDUCE_OPS, DTYPES, OPTIMIZERS, REDUCE_OPS, Error,
                       _DTYPE_NAMES, _ELEM_SIZE,
                       _TORCH_ONLY_KEYS, _TYPESTR, _area_dtype,
                       _array_interface, _b, _dtype_code, _env_int, _err_name,
                       _hparams, _u64)
from .objects import (Buffer, Optimizer, StepResult, View, _CudaArea,
                      _describe, _ids, _is_named_ref, _ref_of)
from .client import (Client, RestoredJob, ResumedJobWarning, _FROM_ENV, _STRATEGIES,
                     _job_from_env, _memory_model, library_path,
                     torchrun_defaults)

__all__ = [
    "Error", "Client", "Buffer", "View", "Optimizer", "StepResult",
    "DTYPES", "OPTIMIZERS", "REDUCE_OPS", "ALL_REDUCE_OPS", "library_path",
    "torchrun_defaults", "RestoredJob",
]


# Their home is shardd, as before the split (reprs, pickles, help()).
for _cls in (Error, Client, Buffer, View, Optimizer, StepResult,
             ResumedJobWarning, RestoredJob):
    _cls.__module__ = __name__
del _cls


def __getattr__(name):
    # The version is libshardd's (shardd.h's SHARDD_VERSION, the project's
    # one version string), read when first asked for.
    if name == "__version__":
        return L.load().shardd_version().decode()
    # ``import shardd`` then ``shardd.nn.ShardedModule``, as torch users
    # write ``torch.nn``: the torch-facing submodules load on first use, so
    # the binding itself still imports without torch.
    if name in ("nn", "optim"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
