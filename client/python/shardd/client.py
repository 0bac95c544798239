"""The connection: :class:`Client` (one rank of a job, or a control
session), with the defaults it takes from torchrun's environment."""
import ctypes
import json as _json
import math
import os
import warnings

from . import _lib as L
from ._convert import (ALL_REDUCE_OPS, OPTIMIZERS, REDUCE_OPS, Error, _b,
                       _dtype_code, _env_int, _err_name, _hparams, _u64)
from .objects import (Buffer, Optimizer, StepResult, View, _ids, _is_named_ref,
                      _ref_of)


# Client's job default: TORCHELASTIC_RUN_ID when set, else a control session
_FROM_ENV = object()


_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


class ResumedJobWarning(UserWarning):
    """A Client joined a job that holds trained state (a relaunch after its
    ranks died, a rank rejoining, a restored job): it resumes it."""


class RestoredJob(str):
    """What Client.restore returns: the restored job's name, a str as
    before (compares equal to the name, passes wherever a job name goes),
    with .step, the step the job resumes at (the most steps one of its
    optimizers took; 0 when none stepped). A str subclass rather than a
    tuple, so callers that use the name unchanged keep working."""

    def __new__(cls, name, step):
        self = super().__new__(cls, name)
        self.step = int(step)
        return self

    def __reduce__(self):  # pickled (a multiprocessing queue) with its step
        return (RestoredJob, (str(self), self.step))


def _job_from_env(run_id):
    """Client's job when none is given: $TORCHELASTIC_RUN_ID when it names
    this launch (torchrun --rdzv_id=ID, or --standalone's fresh id; its
    elastic restarts share it and resume), None (a control session) when
    it is unset. torchrun's default "none" names no launch: as a job name
    every such launch would be one job, a rerun continuing the last run's
    weights, so it is refused."""
    if run_id is not None and run_id.strip().lower() == "none":
        raise ValueError(
            "$TORCHELASTIC_RUN_ID is %r (torchrun's default without --rdzv_id): "
            "it does not identify this run, so shardd will not use it as the job "
            "name (every such launch would share one job, and a rerun would "
            "resume the previous run). Pass job=NAME (the same on every rank, "
            "new for each run), or launch with torchrun --standalone or "
            "--rdzv_id=RUN_ID" % run_id)
    return run_id


def _memory_model(transient_areas, reshard_after_forward, sharding_strategy):
    """Transient areas (True) or resident (False) from Client's three
    spellings of it; FULL_SHARD (transient) when none is given."""
    said = []
    for name, v in (("transient_areas", transient_areas),
                    ("reshard_after_forward", reshard_after_forward)):
        if v is None:
            continue
        if v not in (True, False):  # also 0 and 1
            raise TypeError("%s must be a bool, not %r" % (name, v))
        said.append((name, bool(v)))
    if sharding_strategy is not None:
        key = getattr(sharding_strategy, "name", sharding_strategy)
        if key not in _STRATEGIES:
            raise ValueError("sharding_strategy %r: shardd has FULL_SHARD (transient "
                             "areas, the default) and SHARD_GRAD_OP (resident areas)"
                             % (sharding_strategy,))
        said.append(("sharding_strategy", _STRATEGIES[key]))
    if len({v for _, v in said}) > 1:
        raise ValueError("conflicting memory models: %s" % ", ".join(
            "%s says %s" % (n, "transient (FULL_SHARD)" if v else "resident (SHARD_GRAD_OP)")
            for n, v in said))
    return said[0][1] if said else True


def torchrun_defaults():
    """(job, rank, world) as torchrun (torch.distributed.run) sets them:
    $TORCHELASTIC_RUN_ID, $RANK (else $LOCAL_RANK, a single-node launcher's),
    $WORLD_SIZE; None for each one that is unset."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or None
    rank = _env_int("RANK", 0)
    if rank is None:
        rank = _env_int("LOCAL_RANK", 0)
    return job, rank, _env_int("WORLD_SIZE", 1)


def library_path():
    """The path libshardd was loaded from."""
    return L.path()


class Client:
    """One connection = one rank of a job (shardd_connect).

    socket: daemon socket path (None: $SHARDD_SOCKET, then the default).
    job None or "" opens a control session (status/inspect only).
    Under torchrun the defaults come from its environment
    (:func:`torchrun_defaults`): job not given is $TORCHELASTIC_RUN_ID (a
    control session when that is unset; torchrun's "none", its value
    without --rdzv_id or --standalone, is refused: it names no run), rank
    not given is $RANK (else $LOCAL_RANK, else 0) and world not given is
    $WORLD_SIZE (else 1). The daemon picks the rank's device from the rank,
    as always.
    A job whose ranks all close() is finished: the daemon frees it, and a
    new run of its name starts fresh. A job whose ranks died (or were
    closed with finished=False) lingers for the daemon's --job-linger; a
    relaunch resumes it, and each rank's Client says so (resumed_step, and
    a ResumedJobWarning "resuming job NAME at step N").
    The memory model is FSDP's default, FULL_SHARD: transient areas
    (buffers keep only the shard and the reduced shard, and gather_area()
    leases the whole-buffer areas per gather; see the module docstring).
    Resident areas (every block keeps its gather and gradient areas, FSDP's
    SHARD_GRAD_OP: no re-gather in backward, more memory) are opt-in under
    FSDP's names, reshard_after_forward=False or
    sharding_strategy="SHARD_GRAD_OP" (a torch ShardingStrategy is taken
    too); transient_areas=True/False says the same in shardd's words. The
    Hello that creates the job decides; a rank asking otherwise is refused
    (E_MISMATCH).
    timeout: seconds the daemon may stay silent before a call fails with
    Error E_TIMEOUT ("daemon at SOCKET did not answer for N s": stopped or
    hung) instead of blocking forever; None: $SHARDD_TIMEOUT, else 60; 0:
    wait forever. A collective waiting for a slow peer is not failed by it
    (the client pings the daemon meanwhile, and the daemon answers).
    Not thread-safe: use one Client per thread/rank.
    """

    def __init__(self, socket=None, job=_FROM_ENV, rank=None, world=None, client_name=None,
                 transient_areas=None, reshard_after_forward=None, sharding_strategy=None,
                 timeout=None):
        self._lib = L.load()
        self._c = None
        transient_areas = _memory_model(transient_areas, reshard_after_forward,
                                        sharding_strategy)
        env_job, env_rank, env_world = torchrun_defaults()
        if job is _FROM_ENV:
            job = _job_from_env(env_job)
        if rank is None:
            rank = env_rank if env_rank is not None else 0
        if world is None:
            world = env_world if env_world is not None else 1
        if job and not 0 <= rank < world:
            raise ValueError("rank %d is outside world %d (from %s)" % (
                rank, world, "$RANK/$WORLD_SIZE" if env_rank is not None or
                env_world is not None else "the arguments"))
        self.socket = socket
        self.job = job
        self.rank = rank
        self.world = world
        self.transient_areas = bool(transient_areas)
        self.buffers = {}
        self._cuda_devices = set()  # GPUs of the device areas handed out as tensors
        # steps this client requested: a step consumes the reduced gradients
        # of its buffers (the daemon's next scatter replaces them), which
        # shardd.nn needs to know to accumulate as torch's .grad does
        self.steps_requested = 0
        # the wrappers over this client (weak references to objects with
        # _check_step(opt) / _stepped(opt), shardd.nn's ShardedModule): a
        # step asked of the client directly, below the wrapper, gets the
        # wrapper's refusals and bookkeeping too (its own step sets
        # _wrapper_step around this one)
        self._step_guards = []
        # called after close() (shardd.nn forgets the closed wrappers' parts)
        self._close_hooks = []
        self._wrapper_step = False
        # optimizer id -> the scale its clips since its last step set for
        # that step's gradients (the daemon's clip_scale)
        self._clip_scale = {}
        opts = L.ConnectOpts()
        opts.size = ctypes.sizeof(L.ConnectOpts)
        opts.job = _b(job)
        opts.rank = rank
        opts.world = world
        opts.client_name = _b(client_name if client_name is not None else "python")
        opts.transient_areas = 1 if transient_areas else 0
        if timeout is not None and not timeout >= 0:
            raise ValueError("timeout %r: must be seconds >= 0 (0: none)" % (timeout,))
        # the C API's 0 is "the default" and negative "none"
        opts.timeout_s = 0.0 if timeout is None else -1.0 if timeout == 0 else float(timeout)
        out = ctypes.c_void_p()
        errbuf = ctypes.create_string_buffer(1024)
        rc = self._lib.shardd_connect(_b(socket), ctypes.byref(opts), ctypes.byref(out),
                                      errbuf, len(errbuf))
        if rc != 0:
            msg = errbuf.value.decode(errors="replace") or self._lib.shardd_strerror(rc).decode()
            raise Error(rc, msg)
        self._c = out
        step = ctypes.c_uint64()
        # None: a fresh job; else the step the job is resumed at
        self.resumed_step = (int(step.value) if self._lib.shardd_resumed(out, ctypes.byref(step))
                             else None)
        if self.resumed_step is not None:
            warnings.warn("shardd: resuming job %r at step %d (rank %d): the job holds "
                          "trained state (a run whose ranks did not finish with close(), "
                          "or a restore): as it should after a crash, a torchrun elastic "
                          "restart or a restore, but a new run needs a job name of its own"
                          % (job, self.resumed_step, rank), ResumedJobWarning, stacklevel=2)

    # -- lifecycle -------------------------------------------------------
    def close(self, finished=True):
        """Closes the connection; every area mapped on it is unmapped.
        finished (the default): this rank is done with its job and says so
        (shardd_finish); once every rank has, the daemon releases the job
        at once and a new run of its name starts fresh. finished=False
        leaves as a crashed rank does: the job lingers (--job-linger) for a
        relaunch to resume. A with block that ends in an exception, and a
        client garbage-collected without close(), leave that way too."""
        if self._c:
            try:  # no kernel may still use the device areas being closed
                self._sync_cuda()
            except Exception:
                pass
            for b in self.buffers.values():
                b._forget()
            c, self._c = self._c, None
            if finished and self.job:
                self._lib.shardd_finish(c)  # closes c whatever the daemon says
            else:
                self._lib.shardd_close(c)
            for hook in self._close_hooks:
                hook()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(finished=exc_type is None)

    def __del__(self):
        try:
            self.close(finished=False)
        except Exception:
            pass

    @property
    def closed(self):
        return not self._c

    def _check_open(self):
        if not self._c:
            raise Error(19, "client is closed", "E_CLOSED")

    def _sync_cuda(self):
        """Cuda backend: waits for this process's queued GPU work on the GPUs
        whose areas this client handed out as torch tensors, so that the
        daemon reads complete data and overwrites (or the client closes)
        nothing a kernel still uses. Nothing to do on the host backend."""
        if self._cuda_devices:
            import torch
            for d in sorted(self._cuda_devices):
                torch.cuda.synchronize(d)

    def _call(self, rc):
        if rc != 0:
            msg = self._lib.shardd_last_error(self._c).decode(errors="replace")
            if not msg:
                msg = self._lib.shardd_strerror(rc).decode()
            raise Error(rc, msg)

    # -- info --------------------------------------------------------------
    @property
    def daemon_version(self):
        self._check_open()
        return self._lib.shardd_daemon_version(self._c).decode()

    @property
    def daemon_backend(self):
        self._check_open()
        return self._lib.shardd_daemon_backend(self._c).decode()

    def ping(self):
        self._check_open()
        self._call(self._lib.shardd_ping(self._c))

    def _string_out(self, fn, *args):
        self._check_open()
        p = ctypes.c_void_p()
        self._call(fn(self._c, *args, ctypes.byref(p)))
        try:
            return ctypes.string_at(p).decode(errors="replace")
        finally:
            self._lib.shardd_free(p)

    def status(self, first_job=0):
        """Daemon status, parsed from its JSON document. It lists at most
        256 jobs (sorted by name, then owner) from the first_job-th on;
        "jobs_more" says how many follow."""
        return _json.loads(self._string_out(self._lib.shardd_status_json_from,
                                            first_job))

    def status_text(self, first_job=0):
        return self._string_out(self._lib.shardd_status_text_from, first_job)

    def checkpoint(self, directory, job=None, collective=False, timeout=0):
        """Writes the job's registry, shards, optimizer state and step
        counts to directory (absolute, on the daemon's machine, below its
        --checkpoint-root). job None: this client's own.

        collective=True (a rank of a job): every rank calls it with the
        same directory; it is taken once all have, after the collectives
        each sent before it, and returns on every rank when the files are
        written — a checkpoint every k steps from inside the loop.
        Otherwise one client asks (an operator: shardctl checkpoint): with
        timeout > 0 it waits up to that many seconds for the job's next
        quiescent point and is taken there while the ranks train
        (E_TIMEOUT names what it waited on); with timeout 0 it gets E_BUSY
        while a collective of the job is in flight."""
        self._check_open()
        if not os.path.isabs(directory):
            raise ValueError("checkpoint directory %r: must be an absolute path "
                             "(it is the daemon's)" % (directory,))
        if collective:
            if job is not None and job != self.job:
                raise ValueError("a collective checkpoint is of this rank's own job")
            self._sync_cuda()
            self._call(self._lib.shardd_checkpoint_collective(self._c, _b(directory)))
            return
        if timeout:
            self._call(self._lib.shardd_checkpoint_wait(self._c, _b(job), _b(directory),
                                                        float(timeout)))
            return
        self._call(self._lib.shardd_checkpoint(self._c, _b(job), _b(directory)))

    def release_job(self, job):
        """Frees job in the daemon now (shardctl release), so a restore
        into its name can follow: its uid or root only; E_BUSY naming the
        ranks while any is connected. -> (buffers, optimizers) freed."""
        self._check_open()
        nb, no = ctypes.c_uint32(0), ctypes.c_uint32(0)
        self._call(self._lib.shardd_release_job(self._c, _b(job), ctypes.byref(nb),
                                                ctypes.byref(no)))
        return nb.value, no.value

    def restore(self, directory, world=0):
        """Recreates the job recorded in directory (not in the daemon now)
        with world ranks (0: as recorded). -> the job's name, a
        RestoredJob: a str with .step, the step the job resumes at (what
        shardctl restore prints). Its ranks then connect and attach;
        shardd.nn keeps the restored values."""
        self._check_open()
        if not os.path.isabs(directory):
            raise ValueError("checkpoint directory %r: must be an absolute path "
                             "(it is the daemon's)" % (directory,))
        # root restoring another uid's job is told "UID/NAME": up to 266 bytes
        out = ctypes.create_string_buffer(320)
        step = ctypes.c_uint64(0)
        self._call(self._lib.shardd_restore_ex(self._c, _b(directory), int(world), out,
                                               ctypes.sizeof(out), ctypes.byref(step)))
        return RestoredJob(out.value.decode(), step.value)

    def inspect(self, what, text=False):
        """One buffer or view by id (int, Buffer, View) or by name (str);
        parsed JSON, or the text form when text=True."""
        if isinstance(what, str):
            vid, name = 0, _b(what)
        else:
            vid, name = _ids(what), None
        fn = self._lib.shardd_inspect_text if text else self._lib.shardd_inspect_json
        s = self._string_out(fn, vid, name)
        return s if text else _json.loads(s)

    # -- registry ------------------------------------------------------------
    def register_buffer(self, name, dtype, numel, init_checksum=None):
        """Creates the job's flat buffer `name` or attaches to it. -> Buffer
        (its .existing: the shards hold trained or restored values).

        init_checksum: an integer < 2**64 summarising this rank's whole
        initial values; while the buffer is not existing, a rank whose
        checksum differs from the first rank's is refused (E_MISMATCH).

        Registering the same buffer again on this client returns the same
        Buffer object (libshardd would map it anew and unmap the areas the
        earlier arrays point into)."""
        self._check_open()
        code = _dtype_code(dtype)
        for b in self.buffers.values():
            if b.name == name and b.dtype_code == code and b.numel == int(numel):
                return b
        info = L.BufferInfo()
        opts = L.BufferOpts()
        opts.size = ctypes.sizeof(L.BufferOpts)
        if init_checksum is not None:
            opts.has_init_checksum = 1
            opts.init_checksum = _u64(init_checksum, "init_checksum")
        self._call(self._lib.shardd_buffer_register_opts(self._c, _b(name), code,
                                                         _u64(numel, "numel"),
                                                         ctypes.byref(opts),
                                                         ctypes.byref(info)))
        old = self.buffers.get(info.id)
        if old is not None:  # mapped anew: the old mapping is gone
            old._forget()
        buf = Buffer(self, name, info)
        self.buffers[buf.id] = buf
        return buf

    def unregister_buffer(self, buf):
        self._check_open()
        bid = _ids(buf)
        self._sync_cuda()
        self._call(self._lib.shardd_buffer_unregister(self._c, bid))
        b = self.buffers.pop(bid, None)
        if b is not None:
            b._forget()

    def register_buffers(self, buffers):
        """Creates or attaches to many buffers in as few requests as fit
        (250 each, every reply bringing the buffers' descriptors): ->
        [Buffer], in order. buffers: (name, dtype, numel) or (name, dtype,
        numel, init_checksum) tuples, each as register_buffer takes them
        (init_checksum None: none); one this client holds already is
        returned as is, without a request.

        All or nothing: when any entry is refused, no buffer of the call is
        kept and Error.errors lists (index, code_name) of every refused
        entry; entries after a refused request are not checked
        ("E_STATE")."""
        self._check_open()
        items = list(buffers)
        result = [None] * len(items)
        send = []  # (index, name, code, numel, checksum)
        for i, it in enumerate(items):
            if len(it) == 3:
                name, dtype, numel = it
                ck = None
            elif len(it) == 4:
                name, dtype, numel, ck = it
            else:
                raise ValueError("buffers[%d]: (name, dtype, numel[, init_checksum]), "
                                 "not %r" % (i, it))
            code = _dtype_code(dtype)
            for b in self.buffers.values():
                if b.name == name and b.dtype_code == code and b.numel == int(numel):
                    result[i] = b
                    break
            else:
                send.append((i, name, code, _u64(numel, "numel"),
                             None if ck is None else _u64(ck, "init_checksum")))
        n = len(send)
        if n == 0:
            return result
        specs = (L.BufferSpec * n)()
        keep = []
        for k, (i, name, code, numel, ck) in enumerate(send):
            nb = _b(name)
            keep.append(nb)
            e = specs[k]
            e.size = ctypes.sizeof(L.BufferSpec)
            e.name = nb
            e.dtype = code
            e.numel = numel
            e.has_init_checksum = 0 if ck is None else 1
            e.init_checksum = 0 if ck is None else ck
        out = (L.BufferInfo * n)()
        errs = (ctypes.c_int * n)()
        rc = self._lib.shardd_buffers_register(self._c, n, specs, out, errs)
        if rc != 0:
            msg = self._lib.shardd_last_error(self._c).decode(errors="replace")
            e = Error(rc, msg or self._lib.shardd_strerror(rc).decode())
            e.errors = [(send[k][0], _err_name(errs[k])) for k in range(n) if errs[k] != 0]
            raise e
        for k, (i, name, code, numel, ck) in enumerate(send):
            info = out[k]
            b = self.buffers.get(info.id)
            if b is None or b.name != name:
                b = Buffer(self, name, info)
                self.buffers[b.id] = b
            result[i] = b
        return result

    def unregister_buffers(self, buffers):
        """Unregisters many buffers (Buffer objects or ids), each request of
        250 all or nothing: every id is checked before any goes (a Buffer's
        generation too: E_STALE when it is old). On a refusal,
        Error.errors lists (index, code_name) of the refused entries; the
        buffers of requests before it are gone."""
        self._check_open()
        items = list(buffers)
        n = len(items)
        if n == 0:
            return
        self._sync_cuda()
        ids = [_ids(b) for b in items]
        arr = (ctypes.c_uint64 * n)(*ids)
        gens = (ctypes.c_uint64 * n)(*[getattr(b, "generation", 0) or 0
                                       if isinstance(b, Buffer) else 0 for b in items])
        errs = (ctypes.c_int * n)()
        rc = self._lib.shardd_buffers_unregister(self._c, n, arr, gens, errs)
        # the requests before a refused one are done: forget what is gone
        done = n
        if rc != 0:
            done = next((k for k in range(n) if errs[k] != 0), n)
            done -= done % 250
        for bid in ids[:done]:
            b = self.buffers.pop(bid, None)
            if b is not None:
                b._forget()
        if rc != 0:
            self._raise_batch(rc, errs, n)

    def register_view(self, buffer, name, offset, shape, requires_grad=True):
        """Names elements [offset, offset+prod(shape)) of buffer. -> View.

        requires_grad=False registers a frozen range (LoRA base weights):
        scatter skips it, and an optimizer naming it skips it while it stays
        frozen (set_requires_grad changes it)."""
        self._check_open()
        shape = tuple(int(d) for d in shape)
        n = 1
        for d in shape:
            n *= d
        arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        opts = L.ViewOpts(ctypes.sizeof(L.ViewOpts), 1 if requires_grad else 0, 0)
        out = L.ViewInfo()
        self._call(self._lib.shardd_view_register_ex(self._c, _ids(buffer), _b(name),
                                                     _u64(offset, "offset"),
                                                     n, arr, len(shape), ctypes.byref(opts),
                                                     ctypes.byref(out)))
        if not isinstance(buffer, Buffer):
            buffer = self.buffers[_ids(buffer)]
        return View(buffer, out.id, name, int(offset), shape, requires_grad, out.generation)

    def unregister_view(self, view):
        self._check_open()
        self._call(self._lib.shardd_view_unregister(self._c, _ids(view)))

    def register_views(self, views):
        """Registers (or attaches to) many views in as few requests as fit
        (256 views each): -> [View], in order. views: (buffer, name,
        offset, shape) or (buffer, name, offset, shape, requires_grad)
        tuples, each as register_view takes them.

        All or nothing: when any entry is refused, no view of the call is
        kept and Error.errors lists (index, code_name) of every refused
        entry (its message names each, with the reason); entries after a
        refused request are not checked ("E_STATE")."""
        self._check_open()
        items = list(views)
        n = len(items)
        if n == 0:
            return []
        specs = (L.ViewSpec * n)()
        keep = []  # the names and shapes live until the call returns
        bufs = []
        for i, it in enumerate(items):
            if len(it) == 4:
                buffer, name, offset, shape = it
                rg = True
            elif len(it) == 5:
                buffer, name, offset, shape, rg = it
            else:
                raise ValueError("views[%d]: (buffer, name, offset, shape[, "
                                 "requires_grad]), not %r" % (i, it))
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
            nb = _b(name)
            keep.append((nb, arr))
            e = specs[i]
            e.size = ctypes.sizeof(L.ViewSpec)
            e.buffer = _ids(buffer)
            e.name = nb
            e.offset = _u64(offset, "offset")
            e.numel = numel
            e.shape = arr
            e.ndim = len(shape)
            e.requires_grad = 1 if rg else 0
            e.buffer_generation = 0
            bufs.append((buffer, name, int(offset), shape, bool(rg)))
        out = (L.ViewInfo * n)()
        errs = (ctypes.c_int * n)()
        rc = self._lib.shardd_views_register(self._c, n, specs, out, errs)
        if rc != 0:
            self._raise_batch(rc, errs, n)
        views_out = []
        for i, (buffer, name, offset, shape, rg) in enumerate(bufs):
            if not isinstance(buffer, Buffer):
                buffer = self.buffers[_ids(buffer)]
            views_out.append(View(buffer, out[i].id, name, offset, shape, rg,
                                  out[i].generation))
        return views_out

    def unregister_views(self, views):
        """Unregisters many views (View objects or ids), each request of
        256 all or nothing: every id is checked before any goes. A View's
        generation is checked too (E_STALE when it is old). On a refusal,
        Error.errors lists (index, code_name) of the refused entries; the
        views of requests before it are gone."""
        self._check_open()
        items = list(views)
        n = len(items)
        if n == 0:
            return
        ids = (ctypes.c_uint64 * n)(*[_ids(v) for v in items])
        gens = (ctypes.c_uint64 * n)(*[v.generation if isinstance(v, View) else 0
                                       for v in items])
        errs = (ctypes.c_int * n)()
        rc = self._lib.shardd_views_unregister(self._c, n, ids, gens, errs)
        if rc != 0:
            self._raise_batch(rc, errs, n)

    def _raise_batch(self, rc, errs, n):
        msg = self._lib.shardd_last_error(self._c).decode(errors="replace")
        e = Error(rc, msg or self._lib.shardd_strerror(rc).decode())
        e.errors = [(i, _err_name(errs[i])) for i in range(n) if errs[i] != 0]
        raise e

    def register_optimizer(self, kind, groups, name=None, **hyper):
        """Registers (or, when identical under the same name, attaches to) an
        optimizer. -> Optimizer.

        kind: "sgd", "adam", "adamw" (or the C enum value).
        groups: a list of param groups, torch style: each either a dict
          {"params": [refs], <overrides>} or a plain list of refs; a plain
          list of refs (not of groups) is one group. A ref is a Buffer, a
          View, an int id (0 = "not a shardd tensor"), or a (name, ref)
          pair; anything else is sent as id 0 under its repr, which the
          daemon refuses by name.
        hyper: optimizer-wide hyperparameters with torch.optim's names (lr,
          betas, eps, weight_decay, amsgrad, momentum, dampening, nesterov,
          maximize; beta1/beta2 also accepted). Unset ones take torch's
          defaults on the daemon.
        """
        self._check_open()
        if isinstance(kind, str):
            if kind.lower() not in OPTIMIZERS:
                raise ValueError("unknown optimizer kind %r (sgd, adam, adamw)" % kind)
            kcode = OPTIMIZERS[kind.lower()]
        else:
            kcode = int(kind)
        groups = list(groups)
        if groups and not all(isinstance(g, (dict, list, tuple)) and not _is_named_ref(g)
                              for g in groups):
            groups = [groups]  # a flat list of refs is one group
        keep, held = [], []
        cgroups = (L.ParamGroup * max(1, len(groups)))()
        for gi, g in enumerate(groups):
            if isinstance(g, dict):
                refs = list(g["params"])
                ov = _hparams(g, "param group %d" % gi)
            else:
                refs = list(g)
                ov = L.HParams()
            crefs = (L.ParamRef * max(1, len(refs)))()
            for ri, r in enumerate(refs):
                rid, rname = _ref_of(r, gi, ri)
                held.append(rid)
                nb = _b(rname)
                keep.append(nb)
                crefs[ri].id = rid
                crefs[ri].name = nb
            keep.append(crefs)
            cgroups[gi].refs = ctypes.cast(crefs, ctypes.POINTER(L.ParamRef))
            cgroups[gi].nrefs = len(refs)
            cgroups[gi].overrides = ov
        top = _hparams(hyper, "optimizer")
        out = ctypes.c_uint64()
        self._call(self._lib.shardd_optimizer_register(
            self._c, _b(name), kcode, ctypes.byref(top), cgroups, len(groups),
            ctypes.byref(out)))
        opt = Optimizer(self, out.value, name or "default",
                        kind if isinstance(kind, str) else kcode)
        # the ids it holds (views, or buffers: all their views): whose .grad
        # a clip of it scales (_clipped)
        opt.refs = frozenset(held)
        return opt

    def unregister_optimizer(self, opt):
        self._check_open()
        self._call(self._lib.shardd_optimizer_unregister(self._c, _ids(opt)))

    # -- collectives ---------------------------------------------------------
    def gather(self, buffer):
        """All-gather (collective): every rank's gather area gets the buffer."""
        self._check_open()
        self._check_gather([buffer])
        self._sync_cuda()
        self._call(self._lib.shardd_gather(self._c, _ids(buffer)))

    def gather_async(self, buffer, want_grad=False):
        """Starts the all-gather of buffer and returns a ticket at once (for
        prefetching the next layer while computing this one); at most
        max_inflight_gathers are in flight, the oldest being waited for
        first. Pass the ticket to wait() or wait_area(). want_grad (transient
        areas): also lease the gradient area, as gather_area(want_grad=True)
        does (backward prefetch)."""
        self._check_open()
        if want_grad not in (True, False):
            raise TypeError("want_grad must be a bool, not %r" % (want_grad,))
        self._check_gather([buffer])
        self._sync_cuda()
        t = ctypes.c_uint64(0)
        if want_grad:
            self._call(self._lib.shardd_gather_area_async(self._c, _ids(buffer), 1,
                                                          ctypes.byref(t)))
        else:
            self._call(self._lib.shardd_gather_async(self._c, _ids(buffer), ctypes.byref(t)))
        return t.value

    def wait(self, ticket):
        """Waits for the gather (or release) a ticket from gather_async()
        (release_async()) stands for; raises its error."""
        self._check_open()
        self._call(self._lib.shardd_wait(self._c, ctypes.c_uint64(ticket)))

    def _buffer_of(self, buffer):
        """A Buffer registered on this client, from a Buffer or an id."""
        if isinstance(buffer, Buffer):
            if buffer.client is not self:
                raise ValueError("%r was registered on another client" % (buffer,))
            b = self.buffers.get(buffer.id)
            if b is not buffer:
                raise ValueError("%r is not registered on this client any more" % (buffer,))
            return b
        if isinstance(buffer, (View, Optimizer)) or isinstance(buffer, bool):
            raise TypeError("a buffer (Buffer or id) is needed, not %r" % (buffer,))
        b = self.buffers.get(int(buffer))
        if b is None:
            raise ValueError("buffer id %d is not registered on this client" % int(buffer))
        return b

    def _areas(self, buf, area, want_grad):
        g = buf._leased_tensor(area.gather, "gather area") if area.gather else None
        if g is None:
            raise Error(24, "buffer %d: the gather handed out no gather area" % buf.id,
                        "E_INTERNAL")
        gr = None
        if want_grad:
            if not area.grad:
                raise Error(24, "buffer %d: a gather with want_grad handed out no "
                            "gradient area" % buf.id, "E_INTERNAL")
            gr = buf._leased_tensor(area.grad, "gradient area")
        return g, gr

    def gather_area(self, buffer, want_grad=False):
        """All-gather (collective) into this rank's gather area. ->
        (gather, grad): torch tensors (no copy) of padded_numel elements over
        the areas, grad None unless want_grad.

        Transient areas: both are leased; gather is held until
        release(buffer), grad (zeroed by the daemon, this rank's own) until
        the scatter of the buffer that consumes it. On the host backend
        gather is the node's one copy of the buffer, which every local rank
        holding it reads: mapped read-only, a write into it faults (SIGSEGV);
        on cuda it is this rank's, in its device's pool. Gathering a buffer whose
        areas this rank holds already keeps them (and gathers again). At
        most 2 gather and 2 gradient areas per rank: a third is refused
        with E_LIMIT naming what the rank holds (release one first).
        Resident areas: the block's gather and grad areas (as
        buf.gather_tensor and buf.grad_tensor)."""
        self._check_open()
        if want_grad not in (True, False):
            raise TypeError("want_grad must be a bool, not %r" % (want_grad,))
        buf = self._buffer_of(buffer)
        self._sync_cuda()
        area = L.Area()
        self._call(self._lib.shardd_gather_area(self._c, buf.id, 1 if want_grad else 0,
                                                ctypes.byref(area)))
        return self._areas(buf, area, want_grad)

    def wait_area(self, ticket, buffer, want_grad=False):
        """wait(ticket) for a gather_async(buffer), and where it put this
        rank's areas: -> (gather, grad) as gather_area(), grad None unless
        the gather_async had want_grad (pass the same here)."""
        self._check_open()
        buf = self._buffer_of(buffer)
        area = L.Area()
        self._call(self._lib.shardd_wait_area(self._c, ctypes.c_uint64(ticket),
                                              ctypes.byref(area)))
        return self._areas(buf, area, bool(want_grad))

    def release_all(self, buffer):
        """release(), and the gradient area this rank holds of buffer too
        (unscattered: an iteration abandoned after a peer was lost)."""
        self._check_open()
        buf = self._buffer_of(buffer)
        self._sync_cuda()
        self._call(self._lib.shardd_release_all(self._c, buf.id))

    def release(self, buffer):
        """Returns this rank's gather area of buffer to its pool (FSDP's
        reshard): the gather tensor gather_area() returned must not be used
        any more. E_STATE when this rank holds no gather area of it or the
        job has resident areas."""
        self._check_open()
        buf = self._buffer_of(buffer)
        self._sync_cuda()  # no kernel may still read the area being returned
        self._call(self._lib.shardd_release(self._c, buf.id))

    def release_async(self, buffer):
        """release() without waiting for the daemon's answer: returns a
        ticket at once; wait(ticket) returns (or raises) the release's
        result. The daemon serves this client's requests in order, so every
        later request (a gather needing the lease) finds the area back in
        its pool."""
        self._check_open()
        buf = self._buffer_of(buffer)
        self._sync_cuda()  # no kernel may still read the area being returned
        t = ctypes.c_uint64(0)
        self._call(self._lib.shardd_release_async(self._c, buf.id, ctypes.byref(t)))
        return t.value

    def scatter(self, buffer, op="mean", no_grad=None, accumulate=False):
        """Reduce-scatter (collective) of every rank's grad area; op "sum"/"mean".

        no_grad: torch's skip semantics. The views of buffer (View objects or
        ids) whose gradient is None on this rank -- the grad area holds zeros
        there -- or True for the whole buffer. A view no rank had a gradient
        for (in any scatter since the last step) is skipped by the next step
        (no weight decay, no moment update, its own step count stays), as
        torch.optim skips a parameter whose .grad is None; one with a
        gradient on some ranks is stepped. None (the default): every view
        had one.
        accumulate=True: add the result to the reduced gradient the
        buffer's scatters since its last step left (a later backward of
        gradient accumulation, as torch's .grad adds up over backward
        calls); it replaces it when a step consumed it since. Every rank
        passes the same."""
        self._check_open()
        self._sync_cuda()
        if isinstance(op, str):
            if op.lower() not in REDUCE_OPS:
                raise ValueError("reduce op %r: one of %s" % (op, ", ".join(sorted(REDUCE_OPS))))
            code = REDUCE_OPS[op.lower()]
        else:
            code = int(op)
        if (no_grad is None or no_grad is False) and not accumulate:
            self._call(self._lib.shardd_scatter(self._c, _ids(buffer), code))
            return
        so = L.ScatterOpts()
        so.size = ctypes.sizeof(L.ScatterOpts)
        so.op = code
        so.accumulate = 1 if accumulate else 0
        if no_grad is True:
            so.no_grad_all = 1
        elif no_grad:
            ids = [_ids(v) for v in no_grad]
            if ids:
                arr = (ctypes.c_uint64 * len(ids))(*ids)
                so.no_grad = ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint64))
                so.nno_grad = len(ids)
        self._call(self._lib.shardd_scatter_ex(self._c, _ids(buffer), ctypes.byref(so)))

    def _reduce_code(self, op):
        if isinstance(op, str):
            if op.lower() not in REDUCE_OPS:
                raise ValueError("reduce op %r: one of %s" % (op, ", ".join(sorted(REDUCE_OPS))))
            return REDUCE_OPS[op.lower()]
        return int(op)

    def gather_many(self, buffers):
        """Bucketed all-gather (collective): gathers every buffer (Buffer
        objects or ids) with one request per up to 64 of them instead of
        one each, as gather() would (resident areas: each buffer's
        gather_tensor). Every rank passes the same buffers in the same
        order; a rank that differs fails the buckets involved at once with
        E_MISMATCH on every rank. Each request is all or nothing up front:
        a refused entry (unknown, stale, named twice) runs none of it and
        Error.errors lists (index, code_name) of every refused entry.
        Transient jobs refuse gather buckets (E_STATE: each gather leases a
        slot of the 2 a rank may hold)."""
        self._check_open()
        items = list(buffers)
        n = len(items)
        if n == 0:
            return
        self._check_gather(items)
        self._sync_cuda()
        arr = (ctypes.c_uint64 * n)(*[_ids(b) for b in items])
        errs = (ctypes.c_int * n)()
        rc = self._lib.shardd_gather_many(self._c, n, arr, errs)
        if rc != 0:
            self._raise_batch(rc, errs, n)

    def scatter_many(self, buffers, op="mean", no_grad=None, accumulate=False):
        """Bucketed reduce-scatter (collective) of every buffer's grad area,
        as gather_many() gathers them (transient areas too: a scatter leases
        nothing). no_grad: None, or one entry per buffer, each what
        scatter()'s no_grad takes (None, True, or the views without a
        gradient on this rank). accumulate as in scatter(), for all."""
        self._check_open()
        items = list(buffers)
        n = len(items)
        if n == 0:
            return
        self._sync_cuda()
        code = self._reduce_code(op)
        if no_grad is not None and len(no_grad) != n:
            raise ValueError("no_grad: %d entries for %d buffers" % (len(no_grad), n))
        arr = (ctypes.c_uint64 * n)(*[_ids(b) for b in items])
        errs = (ctypes.c_int * n)()
        if no_grad is None and not accumulate:
            rc = self._lib.shardd_scatter_many(self._c, n, arr, code, errs)
        else:
            opts = (L.ScatterOpts * n)()
            keep = []
            for i in range(n):
                so = opts[i]
                so.size = ctypes.sizeof(L.ScatterOpts)
                so.op = code
                so.accumulate = 1 if accumulate else 0
                ng = None if no_grad is None else no_grad[i]
                if ng is True:
                    so.no_grad_all = 1
                elif ng:
                    ids = [_ids(v) for v in ng]
                    if ids:
                        a = (ctypes.c_uint64 * len(ids))(*ids)
                        keep.append(a)
                        so.no_grad = ctypes.cast(a, ctypes.POINTER(ctypes.c_uint64))
                        so.nno_grad = len(ids)
            rc = self._lib.shardd_scatter_many_ex(self._c, n, arr, opts, errs)
        if rc != 0:
            self._raise_batch(rc, errs, n)

    def set_requires_grad(self, view, requires_grad):
        """Freezes (False) or unfreezes (True) a view for the whole job:
        gradual unfreezing. An optimizer holding it keeps it; its steps skip it
        while it is frozen, and step it again, with its own step count, once
        it is not. Any one rank of a node may say it for that node's daemon
        (in a multi-node job a rank of every node must); it applies to
        collectives not started yet, so call it before this rank's next
        scatter."""
        self._check_open()
        self._call(self._lib.shardd_view_set_requires_grad(
            self._c, _ids(view), 1 if requires_grad else 0))
        if isinstance(view, View):
            view.requires_grad = bool(requires_grad)
        vid = _ids(view)
        for g in self._live_guards():  # the parameter follows
            g._view_requires_grad(vid, bool(requires_grad))

    def all_reduce(self, values, op="sum"):
        """All-reduce (collective) of a few float64 scalars over the job's
        ranks, for metrics and loss logging: values is a number or a
        sequence of at most 64 numbers (a list, a numpy array, a CPU torch
        tensor), the same count and op ("sum", "mean", "max", "min") on
        every rank. Returns the reduction, taken in rank order so every rank
        gets the same bits: a float for a number, else a list of floats."""
        self._check_open()
        if isinstance(op, str):
            if op.lower() not in ALL_REDUCE_OPS:
                raise ValueError("all_reduce op %r: one of %s" % (
                    op, ", ".join(sorted(ALL_REDUCE_OPS))))
            code = ALL_REDUCE_OPS[op.lower()]
        else:
            code = int(op)
        scalar = not hasattr(values, "__len__") and not hasattr(values, "__iter__")
        if hasattr(values, "detach"):  # a torch tensor
            t = values.detach()
            scalar = t.dim() == 0
            vals = [float(x) for x in t.reshape(-1).tolist()]
        elif scalar:
            vals = [float(values)]
        else:
            vals = [float(x) for x in values]
        if len(vals) > L.ALL_REDUCE_MAX:
            raise ValueError("all_reduce of %d values: at most %d (it is for "
                             "metrics; reduce tensors with gather/scatter)"
                             % (len(vals), L.ALL_REDUCE_MAX))
        arr = (ctypes.c_double * max(len(vals), 1))(*vals)
        self._call(self._lib.shardd_all_reduce(self._c, arr, len(vals), code))
        out = [arr[i] for i in range(len(vals))]
        return out[0] if scalar else out

    def seed_master(self, buffer, values):
        """A 16-bit buffer's fp32 master from exact values (as FSDP's mixed
        precision keeps the fp32 parameters): values, this rank's shard as
        fp32 (shard_numel elements, or fewer: the rest are zeros), become
        the master of every optimizer over this rank's shard and of those
        registered later until the buffer's first step."""
        self._check_open()
        buf = self._buffer_of(buffer)
        red = buf.reduced_tensor
        red.zero_()
        n = values.numel()
        if n > red.numel():
            raise ValueError("seed_master: %d values for a shard of %d" % (n, red.numel()))
        red[:n].copy_(values.reshape(-1).to(red.dtype))
        self._sync_cuda()
        self._call(self._lib.shardd_seed_master(self._c, buf.id))

    def optim_state(self, opt, ref, arrays=True, offset=0, count=None):
        """One parameter's optimizer state as torch keeps it per parameter:
        ref a View or Buffer (or id) opt holds. -> dict(nstate, numel,
        steps (its step count), optimizer_steps, arrays: the nstate fp32
        state arrays -- Adam: exp_avg, exp_avg_sq [, max_exp_avg_sq]; SGD
        with momentum: momentum_buffer -- as flat numpy arrays over the
        parameter's elements [offset, offset+count) (count None: to its
        end; a rank's own shard of it for a sharded state dict), or []
        with arrays=False)."""
        import numpy as np
        self._check_open()
        info = L.OptimStateInfo()
        oid, rid = _ids(opt), _ids(ref)
        self._call(self._lib.shardd_optim_state_get(self._c, oid, rid, 0, 0, 0, None,
                                                    ctypes.byref(info)))
        offset = int(offset)
        count = int(info.numel) - offset if count is None else int(count)
        out = []
        for k in range(info.nstate if arrays else 0):
            a = np.empty(count, dtype=np.float32)
            if count > 0:
                ptr = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                self._call(self._lib.shardd_optim_state_get(self._c, oid, rid, k, offset,
                                                            count, ptr, None))
            out.append(a)
        return {"nstate": int(info.nstate), "numel": int(info.numel),
                "steps": int(info.steps), "optimizer_steps": int(info.optimizer_steps),
                "arrays": out}

    def set_optim_state(self, opt, ref, arrays=(), steps=None, optimizer_steps=None,
                        offset=0):
        """Writes a parameter's state arrays (flat fp32, in optim_state's
        order, each over its elements from offset) and, when given, its
        step count and the optimizer's (optimizer_steps None: unchanged)."""
        import numpy as np
        self._check_open()
        oid, rid = _ids(opt), _ids(ref)
        for k, a in enumerate(arrays):
            a = np.ascontiguousarray(np.asarray(a, dtype=np.float32).reshape(-1))
            if a.size == 0:
                continue
            ptr = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            self._call(self._lib.shardd_optim_state_set(self._c, oid, rid, k, int(offset),
                                                        a.size, ptr))
        if steps is not None:
            if optimizer_steps is None:
                optimizer_steps = self.optim_state(opt, ref, arrays=False)["optimizer_steps"]
            self._call(self._lib.shardd_optim_steps_set(self._c, oid, rid, int(steps),
                                                        int(optimizer_steps)))

    def optim_master(self, opt, ref, offset=0, count=None):
        """The fp32 master of a 16-bit parameter (what opt's steps update
        and round into the shard, as FSDP's mixed precision keeps the fp32
        parameters), over its elements [offset, offset+count) -> flat
        numpy fp32. ref may be a view of opt's buffers that opt does not
        hold (their master is the seed or the shard's widening). E_INVAL
        for an fp32 parameter (its shard is its master), E_STATE before the
        master exists (no step, no seed)."""
        import numpy as np
        self._check_open()
        oid, rid = _ids(opt), _ids(ref)
        if count is None:  # what the master answers (a view opt does not hold too)
            info = L.OptimStateInfo()
            self._call(self._lib.shardd_optim_state_get(self._c, oid, rid, L.OPTIM_MASTER,
                                                        0, 0, None, ctypes.byref(info)))
            count = int(info.numel) - int(offset)
        a = np.empty(int(count), dtype=np.float32)
        ptr = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        # count 0 still asks: an fp32 parameter is refused even so
        self._call(self._lib.shardd_optim_state_get(self._c, oid, rid, L.OPTIM_MASTER,
                                                    int(offset), a.size, ptr, None))
        return a

    def set_optim_master(self, opt, ref, values, offset=0):
        """Writes a 16-bit parameter's fp32 master from offset (a master
        not taken yet is taken from the shard first, as the first step
        would, so the elements not written keep their values)."""
        import numpy as np
        self._check_open()
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))
        ptr = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._call(self._lib.shardd_optim_state_set(self._c, _ids(opt), _ids(ref),
                                                    L.OPTIM_MASTER, int(offset), a.size, ptr))

    def barrier(self):
        """Returns once every rank of the job has called barrier()."""
        self._check_open()
        self._call(self._lib.shardd_barrier(self._c))

    def step(self, opt, lr=None, max_norm=None, groups=None, expect_step=None):
        """Optimizer step (collective). lr: override the registered rates for
        this step; max_norm: clip the global grad norm (inf: report it
        only); groups: None, or one dict per param group in registration
        order of torch-named hyperparameters for this step (lr, betas,
        weight_decay, ...: what a scheduler left in torch's param_groups),
        overlaid after lr. expect_step: the step count this step makes (the
        count before it + 1), so a retry after a lost reply (a stopped
        daemon, a broken connection) never steps twice: if the optimizer
        reached it already nothing runs and applied is False; more than one
        step short of it raises E_MISMATCH. -> StepResult(step, total_norm,
        applied) (total_norm is the pre-clip norm when max_norm is given)."""
        self._check_open()
        self._sync_cuda()
        so = L.StepOpts()
        so.size = ctypes.sizeof(L.StepOpts)
        if lr is not None and not (float(lr) >= 0.0 and math.isfinite(float(lr))):
            # -1 meant "the registered rate" to the C API, so a negative lr
            # was ignored without a word; torch raises for it too
            raise ValueError("Invalid learning rate: %r" % (lr,))
        so.lr = -1.0 if lr is None else float(lr)
        so.max_norm = 0.0 if max_norm is None else float(max_norm)
        if max_norm is not None and not so.max_norm >= 0.0:
            raise ValueError("max_norm %r: must be >= 0 (inf: report the norm only)"
                             % (max_norm,))
        if groups:
            arr = (L.HParams * len(groups))()
            for gi, g in enumerate(groups):
                arr[gi] = _hparams(g, "step: param group %d" % gi)
            so.groups = ctypes.cast(arr, ctypes.POINTER(L.HParams))
            so.ngroups = len(groups)
        skipped = ctypes.c_int(0)
        if expect_step is not None:
            so.expect_step = _u64(expect_step, "expect_step")
            if so.expect_step == 0:
                raise ValueError("expect_step 0: a step makes count 1 at least")
        so.skipped = ctypes.pointer(skipped)
        res = L.StepResult()
        guards = [] if self._wrapper_step else self._guards_of(opt)
        for g in guards:  # refusals before anything changed
            g._check_step(opt)
        for g in guards:  # a .grad held with no backward since: as sm.step's
            g._before_daemon_step()
        self.steps_requested += 1
        self._call(self._lib.shardd_step(self._c, _ids(opt), ctypes.byref(so), ctypes.byref(res)))
        scale = self._clip_scale.pop(_ids(opt), 1.0)
        if max_norm is not None and so.max_norm > 0:  # total_norm: as the clips left them
            scale *= min(1.0, so.max_norm / (float(res.total_norm) + 1e-6))
        for g in guards:
            g._stepped(opt)
        if scale < 1.0 and not skipped.value:
            for g in self._guards_of(opt):
                g._clipped(opt, scale)
        return StepResult(int(res.step), float(res.total_norm), not skipped.value)

    def _check_gather(self, buffers):
        """The wrappers' refusals of a gather of buffers (resident: a write
        into their parameters since the last gather, which it overwrites)."""
        ids = {_ids(b) for b in buffers}
        for g in self._live_guards():
            g._check_gather(ids)

    def _live_guards(self):
        """The wrappers over this client still alive (held by weak reference)."""
        return [g for g in (w() for w in self._step_guards) if g is not None]

    def _guards_of(self, opt):
        """The wrappers a direct step of opt concerns: those it was
        registered through, or every one where none was."""
        live = self._live_guards()
        oid = getattr(opt, "id", None)
        mine = [g for g in live if any(getattr(o, "id", None) == oid
                                       for o in getattr(g, "_optims", ()))]
        return mine or live

    def clip_grad_norm(self, opt, max_norm=math.inf):
        """FSDP's clip_grad_norm_ (collective): -> the global L2 norm of the
        reduced gradients opt's next step would apply, over every shard;
        a finite max_norm > 0 makes that step scale them by
        min(1, max_norm / (norm + 1e-6)), and once it ran, the .grad of
        the shardd.nn parameters it stepped (which keep that gradient), as
        torch's clip scales .grad in place. inf (default) or 0: the norm
        only. The wrappers over the client refuse it as their
        clip_grad_norm_ (resident: after a backward no scatter() reduced)
        and hand the daemon a .grad held with no backward since the last
        step first, as their step does."""
        self._check_open()
        self._sync_cuda()
        max_norm = float(max_norm)
        if not max_norm >= 0.0:
            raise ValueError("max_norm %r: must be >= 0 (inf: the norm only)" % (max_norm,))
        # the wrappers' refusals (resident: gradients no scatter reduced)
        # and preparation (transient: a .grad held with no backward since
        # the last step handed to the daemon again), as their step has them:
        # the norm is of what the next step applies
        guards = self._guards_of(opt)
        for g in guards:
            g._check_clip("client.clip_grad_norm()")
        for g in guards:
            g._before_daemon_step()
        out = ctypes.c_double()
        self._call(self._lib.shardd_clip_grad_norm(self._c, _ids(opt), max_norm,
                                                   ctypes.byref(out)))
        if max_norm > 0:  # the daemon's scale: a second clip multiplies the first's
            self._clip_scale[_ids(opt)] = self._clip_scale.get(_ids(opt), 1.0) * min(
                1.0, max_norm / (out.value + 1e-6))
        return out.value
