"""FSDP's state dicts of a wrapped model: model.state_dict() /
load_state_dict() through torch's state-dict hooks (full or local), and
full_parameters()."""
import contextlib
import zlib

import torch

import shardd

from .part_ops import mark_stale


class FullStateDictConfig:
    """FSDP's FullStateDictConfig: what model.state_dict() of a wrapped
    model gives (ShardedModule.state_dict_type("full", config)).
    offload_to_cpu: the values on the CPU (the cuda backend's parameters
    are on the GPU); rank0_only: only rank 0 gets the values, the other
    ranks an empty dict (every rank still calls it: it is a collective)."""

    def __init__(self, offload_to_cpu=False, rank0_only=False):
        self.offload_to_cpu = bool(offload_to_cpu)
        self.rank0_only = bool(rank0_only)


class _StateDictTypeScope:
    """What state_dict_type() returns: the type is set already; a ``with``
    block puts the previous one back at its end."""

    def __init__(self, sm, old):
        self._sm, self._old = sm, old

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._sm._sd_type, self._sm._sd_config = self._old
        return False


class _StateDicts:
    """ShardedModule's state dicts."""

    def _aliases(self):
        """{qualified name: entry} for every name a parameter has on the
        module (a tied weight has one per holder, as torch's state_dict,
        and a module held under several names, T5's `shared` that is also
        each stack's `embed_tokens`, one per name: torch's state_dict has
        every one, and keeping one gave the others this rank's 1-D part)."""
        mods = {}
        for n, m in self.module.named_modules(remove_duplicate=False):
            mods.setdefault(id(m), []).append(n)
        out = {}
        for u in self.units:
            for e in u.entries:
                for m, attr in e.owners:
                    for mn in mods.get(id(m), ()):
                        out[mn + "." + attr if mn else attr] = e
        return out

    # -- state dicts: model.state_dict() / load_state_dict() (FSDP's) -------
    @contextlib.contextmanager
    def _raw_state_dict(self):
        """The module's own state_dict()/load_state_dict(), without the
        hooks (each parameter as it is now)."""
        self._sd_raw += 1
        try:
            yield
        finally:
            self._sd_raw -= 1

    def state_dict_type(self, kind, config=None):
        """FSDP's state_dict_type: what model.state_dict() gives and
        model.load_state_dict() takes. "full" (the default, FSDP's
        FULL_STATE_DICT): every parameter whole under torch's keys, config
        a FullStateDictConfig (offload_to_cpu, rank0_only); "local": each
        parameter as it is outside forward, its 1-D part of this rank's
        shard (FSDP's LOCAL_STATE_DICT; a rank's own, loadable only into
        the same world size). Set at the call, as FSDP's
        set_state_dict_type; as ``with sm.state_dict_type(...):`` (FSDP's
        context) the previous type is back at the block's end. (A plain
        call used to change nothing: only the ``with`` form did.)"""
        if kind not in ("full", "local"):
            raise ValueError("state_dict_type %r: 'full' or 'local'" % (kind,))
        old = self._sd_type, self._sd_config
        self._sd_type = kind
        if config is not None:
            self._sd_config = config
        return _StateDictTypeScope(self, old)

    def _local_keys(self, sd, prefix):
        """{key in sd: entry} for the parameters' keys under prefix."""
        alias = self._aliases()
        out = {}
        for k in sd:
            if k.startswith(prefix) and k[len(prefix):] in alias:
                out[k] = alias[k[len(prefix):]]
        return out

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """torch's state_dict() hook on the wrapped module: the parameters'
        values (their shard parts) replaced as the state dict type says."""
        if self._sd_raw:
            return None
        keys = self._local_keys(state_dict, prefix)
        if self._sd_type == "local":
            for k, e in keys.items():
                state_dict[k] = e.part.detach().clone()
            return None
        cfg = self._sd_config
        full = self.full_parameters()  # collective: every rank is here
        if cfg.rank0_only and self.client.rank != 0:
            for k in list(state_dict):
                if k.startswith(prefix):
                    del state_dict[k]
            return None
        for k, e in keys.items():
            state_dict[k] = full[e.name]
        for k, dt in self._buffer_dtypes.items():  # buffer_dtype's casts undone
            if prefix + k in state_dict:
                state_dict[prefix + k] = state_dict[prefix + k].to(dt)
        if cfg.offload_to_cpu:
            for k in list(state_dict):
                if k.startswith(prefix) and isinstance(state_dict[k], torch.Tensor):
                    state_dict[k] = state_dict[k].cpu()
        return None

    def _load_state_dict_pre_hook(self, state_dict, prefix, local_metadata, strict,
                                  missing_keys, unexpected_keys, error_msgs):
        """torch's load_state_dict() pre-hook on the wrapped module (torch
        calls it before the module loads anything): a full state dict's
        parameters are written into the shards (each rank its parts), and
        their entries replaced by what the parameters then are, so that
        torch's own copy (and its key and shape checks) finds them."""
        if self._sd_raw or self._sd_type == "local":
            return
        keys = self._local_keys(state_dict, prefix)
        # as torch's: every key of another shape named, the others loaded
        # (torch's own check then finds each key the part's shape)
        bad = set()
        for k, e in keys.items():
            v = state_dict[k]
            if tuple(v.shape) != tuple(e.shape):
                error_msgs.append("size mismatch for %s: copying a param with shape %s "
                                  "from checkpoint, the shape in current model is %s."
                                  % (k, v.shape, torch.Size(e.shape)))
                bad.add(k)
        # torch copies each name in module order, so a tied weight given
        # two values (a checkpoint of an untied model) keeps its last name's
        given = {}
        for name, m in self.module.named_modules(remove_duplicate=False):
            for attr in m._parameters:
                k = prefix + (name + "." if name else "") + attr
                if k in keys and k not in bad:
                    given[id(keys[k])] = state_dict[k]
        self._write_full(given)
        for k, e in keys.items():
            state_dict[k] = e.param.detach().clone()

    def _load_state_dict_post_hook(self, module, incompatible_keys):
        """After torch's load_state_dict() copied the values the pre-hook
        gathered into the parameters (resident: into the gather areas,
        the same values): not a write the next gather would lose."""
        if not self.transient and not self._sd_raw and self._sd_type != "local":
            self._gathered_versions()

    def _write_full(self, given):
        """given {id(entry): whole value}: each rank writes its parts into
        its shard (a 16-bit unit's fp32 master from the values given, as at
        construction); resident clients then gather (a collective). Entries
        not given keep theirs."""
        self._release_unbackwarded()
        held = [u.name for u in self.units if self.transient and u.gather is not None]
        if held:
            raise shardd.Error(22, "load_state_dict(): units %s are gathered by a "
                               "forward or backward still" % held, "E_STATE")
        rank = self.client.rank
        with torch.no_grad():
            for u in self.units:
                buf = u.buffer
                sh = buf.shard_tensor
                s0 = rank * buf.shard_numel
                exact = None if u.torch_grads else sh.float()
                for e in u.entries:
                    v = given.get(id(e))
                    if v is None:
                        continue
                    lo = min(max(s0 - e.offset, 0), e.numel)
                    hi = lo + e.part.numel()
                    flat = v.detach().reshape(-1)[lo:hi]
                    e.part.copy_(flat.to(sh.dtype).to(sh.device))
                    if exact is not None and hi > lo:
                        o = e.offset + lo - s0
                        exact[o:o + hi - lo].copy_(flat.float().to(sh.device))
                if exact is not None:
                    # the seed goes through the reduced-gradient shard, which
                    # it leaves zeroed: the gradients kept are gone
                    self.client.seed_master(buf, exact)
                    u.live_at = None
                    for e in u.entries:
                        e.param.grad = None
        if not self.transient:
            self._gathered_versions()  # what was written there is replaced
            self._ahead = None  # the shards changed since the last step's gather
            self.gather()

    def state_dict(self, rank0_only=False, offload_to_cpu=False):
        """FSDP's full state dict: torch's module.state_dict() keys and
        order (both names of a tied weight), every parameter whole (a
        collective: every rank calls it, and each gets the dict, or only
        rank 0 with rank0_only) and the module's buffers as this rank has
        them, so plain torch loads it (model.load_state_dict). What
        model.state_dict() gives in the default state dict type."""
        with self.state_dict_type("full", FullStateDictConfig(offload_to_cpu, rank0_only)):
            return self.module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        """Writes a full state dict (torch's or state_dict()'s) into the
        shards: each rank its parts of every unit (a 16-bit unit's fp32
        master from the values given, as at construction), the buffers
        into the module. Every rank calls it with the same dict; resident
        clients then gather (a collective). What model.load_state_dict()
        does in the default state dict type. The optimizer's state is its
        own: shardd.optim's load_state_dict."""
        with self.state_dict_type("full"):
            return self.module.load_state_dict(state_dict, strict=strict)

    def full_parameters(self, units=None):
        """-> {qualified name: tensor}, copies of the whole parameters as the
        daemon holds them now (collective: every rank must call it, with
        the same units). Resident areas: gathers every unit. Transient:
        gathers and releases one unit at a time (not while a forward or
        backward holds units). units: only these of self.units (all when
        None)."""
        out = {}
        self._release_unbackwarded()
        for u in (self.units if units is None else units):
            if self.transient:
                if u.gather is not None:
                    raise shardd.Error(22, "full_parameters(): unit %r is gathered by "
                                       "a forward or backward still" % u.name, "E_STATE")
                g, _ = self.client.gather_area(u.buffer)
            else:
                self._check_unwritten([u])
                self.client.gather(u.buffer)
                self._gathered_versions([u])
                g = u.buffer.gather_tensor
            try:
                for e in u.entries:
                    out[e.name] = g[e.offset:e.offset + e.numel].view(e.shape).clone()
            finally:
                if self.transient:
                    self.client.release(u.buffer)
        if not self.transient:
            self._stale = None  # every unit gathered: the values after the steps
            mark_stale(self, False)
        return out

    @contextlib.contextmanager
    def gathered_parameters(self, params=None, modifier_rank=None):
        """DeepSpeed's zero.GatheredParameters(params, modifier_rank) as a
        collective context: yields {qualified name: whole tensor}, copies of
        params (parameters of the wrapped model or their names; None: all)
        on every rank, a tied one under each of its names (one tensor).
        With modifier_rank set, the copies written in the
        block are written into the shards at its end, as DeepSpeed's exit
        partitions what it broadcast from that rank. shardd has no
        broadcast: every rank must have made the same writes (seed a draw
        alike), checked over every yielded tensor before anything is
        written; ranks whose values differ (``if rank == 0:`` around the
        write) raise ValueError on every rank naming the parameters, and
        nothing is written. With modifier_rank None a write is refused at
        the block's end (ValueError naming the parameters; DeepSpeed drops
        it without a word). A block that raises writes nothing."""
        world = self.client.world
        if modifier_rank is not None and not 0 <= int(modifier_rank) < world:
            raise ValueError("modifier_rank %r: a rank of the job (0 to %d)"
                             % (modifier_rank, world - 1))
        entries = _entries_named(self, params)
        units = [u for u in self.units if any(id(e) in entries for e in u.entries)]
        wanted = {e.name for e in entries.values()}
        full = {n: t for n, t in self.full_parameters(units).items() if n in wanted}
        before = {n: _crc(t) for n, t in full.items()}
        named = dict(full)  # a tied parameter under each of its names, one tensor
        named.update({k: full[e.name] for k, e in self._aliases().items() if id(e) in entries})
        yield named
        names = sorted(full)
        after = [_crc(full[n]) for n in names]
        changed = [n for n, h in zip(names, after) if h != before[n]]
        if modifier_rank is None:
            if changed:
                raise ValueError(
                    "gathered_parameters(): %s written with modifier_rank=None, "
                    "where the writes are dropped (as DeepSpeed drops them); pass "
                    "modifier_rank to write them into the shards" % ", ".join(changed))
            return
        differ = _ranks_differ(self.client, names, after)
        if differ:
            raise ValueError(
                "gathered_parameters(modifier_rank=%d): the ranks hold different "
                "values of %s at the block's end, nothing written: shardd has no "
                "broadcast of rank %d's values (DeepSpeed's exit broadcasts them), "
                "so make the same write on every rank (the same seed for a draw, "
                "no `if rank == %d:` around it)"
                % (modifier_rank, ", ".join(differ), modifier_rank, modifier_rank))
        if changed:  # the same names on every rank: their copies agree
            by_name = {e.name: e for e in entries.values()}
            self._write_full({id(by_name[n]): full[n] for n in changed})


def _entries_named(sm, params):
    """{id(entry): entry} of params (parameters of the wrapped model, or
    their qualified names; one or a list; None: every parameter)."""
    alias = sm._aliases()
    if params is None:
        return {id(e): e for e in alias.values()}
    if isinstance(params, (str, torch.Tensor)):
        params = [params]
    out = {}
    for p in params:
        e = alias.get(p) if isinstance(p, str) else sm._by_param.get(id(p))
        if e is None:
            raise ValueError("gathered_parameters(): %s is not a parameter of the "
                             "wrapped model" % (repr(p) if isinstance(p, str)
                                                else "a tensor of shape %s" % (tuple(p.shape),)))
        out[id(e)] = e
    return out


def _crc(t):
    """A checksum of a tensor's bytes (exact in a float64: 32 bits)."""
    return zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def _ranks_differ(client, names, hashes):
    """The names whose hash differs between ranks (collective: every rank
    passes the same names). One all-reduce when they agree."""
    def spread(hs):
        got = client.all_reduce(list(hs) + [-h for h in hs], op="max")
        return [got[i] != -got[len(hs) + i] for i in range(len(hs))]
    if not spread([zlib.crc32(repr(hashes).encode())])[0]:
        return []
    out = []
    for i in range(0, len(names), 32):
        out += [n for n, d in zip(names[i:i + 32], spread(hashes[i:i + 32])) if d]
    return out
