#!/usr/bin/env python3
"""check_layers.py — the layer rule of ARCHITECTURE.md, checked on the code.

The folders are the layers: LAYERS below maps each folder (and the three
files loose in daemon/) to its layer, and a file's layer is its folder's.
A module is a file's stem in its folder (x.c and x.h are one module). Every
source folder is read recursively: include/, common/, client/ and daemon/.

Edges between modules come from

  includes  every #include of a file of the tree, in every .c/.h/.cc/.cu
  calls     every undefined symbol of a built object (BUILD/<path>.o) that
            another object of the tree defines (nm), so a call through a
            declaration written by hand counts too

and an edge must go down: to a lower layer of its own side (the daemon's
or the client's; include/ and common/ serve both), or to another module of
its own folder. Inside a folder the modules must form no cycle, except the
groups ONE_OBJECT names: one object split across files, each with why.
What a lower layer tells an upper one goes through the hooks in HOOKS
(function pointers the upper layer hands down; each is checked to be
declared where it says, and listed).

It also fails on: a file in no layer's folder; a source whose object is
missing or older than the source (nothing is checked half: build first;
the CUDA and Gloo sources only when the build's configuration has them);
two headers of one name (includes name headers alone, every folder being
on the include path); a use of the generated wire types (Shardwire__*) in
the daemon outside WIRE; and an ARCHITECTURE.md whose tree or layer table
disagrees with the code. Exit status 1 on any finding.

Usage: scripts/check_layers.py [--root DIR] [BUILD]   (default: the current
directory, and BUILD=build inside it)
"""
import glob
import os
import re
import subprocess
import sys

SOURCE_ROOTS = ("include", "common", "client", "daemon")
SOURCE_RE = re.compile(r"\.(c|h|cc|cu)$")
SKIP_DIRS = {"python", "__pycache__"}  # client/python: the binding, not C

# unit (a folder, or a file's stem loose in daemon/) -> (layer, what it is).
# Higher layers use lower ones. ARCHITECTURE.md's table must say the same.
LAYERS = {
    "include": (0, "the public API (shardd.h)"),
    "common": (1, "what daemon and client share: errors, dtypes, framing, "
                  "strings, the escape of names, the hash"),
    "client": (2, "libshardd and shardctl"),
    "daemon/util": (2, "log, maps, systemd notification"),
    "daemon/fabric": (3, "the cross-node transport (Gloo), or its absence"),
    "daemon/kernels": (4, "the optimizer math, host and device"),
    "daemon/backend": (5, "memory and bulk operations (host, CUDA)"),
    "daemon/registry": (6, "what the daemon owns: jobs' buffers, views, "
                           "optimizers, areas"),
    "daemon/policy": (7, "optimizer rules and registration, access "
                         "decisions"),
    "daemon/checkpoint": (8, "writing and restoring checkpoints"),
    "daemon/engine": (9, "the collective engine"),
    "daemon/jobs": (10, "job lifetime, --job-spec"),
    "daemon/opts": (11, "the configuration (opts.h)"),
    "daemon/rpc": (12, "the command table, its handlers, replies, "
                       "reports"),
    "daemon/net": (13, "the transport: sockets, frames, writes, budgets"),
    "daemon/cli": (14, "the command line"),
    "daemon/main": (15, "the composition root"),
}

# Modules of one folder that may form a cycle: one object split across
# files (they share its internal header), each group with why.
ONE_OBJECT = {
    "daemon/registry": [
        ({"registry", "registry_int", "buffer", "views", "held", "seed",
          "optimizer", "areas"},
         "the registry: one object (registry_int.h) whose buffers, views, "
         "held views, fp32 seeds, optimizers and areas are kept in their "
         "own files"),
    ],
    "daemon/engine": [
        ({"coll", "coll_int", "coll_work", "coll_bulk", "coll_fabric",
          "coll_submit", "coll_phase", "coll_run", "coll_members",
          "coll_exchange", "coll_join", "coll_helper"},
         "the engine: one object (coll_int.h) whose submission, phases, "
         "running tasks, its helper thread, members, bulk path and "
         "multi-node state (its "
         "exchange and join) are kept in their own files"),
    ],
    "daemon/net": [
        ({"server", "server_int", "reads", "framebudget", "replybudget"},
         "the server: one object (server_int.h) whose reads and budgets "
         "are kept in their own files"),
    ],
    "daemon/rpc": [
        ({"dispatch", "dispatch_int", "reply", "session", "register",
          "training", "buckets", "ckpt_operator", "ckpt_collective"},
         "the dispatcher: the command table (dispatch_int.h) and its "
         "handlers, which answer through its reply builder and hold "
         "frames in its table"),
    ],
    "daemon/jobs": [
        ({"jobs", "jobs_int", "jobs_ckpt"},
         "the jobs: one object (jobs_int.h) whose lifetime (jobs.c) and "
         "checkpoints and restores (jobs_ckpt.c) are kept in their own "
         "files"),
    ],
    "daemon/checkpoint": [
        ({"fdstore", "fdstore_int", "fdstore_adopt"},
         "the fd store: one object (fdstore_int.h) whose descriptions and "
         "journal (fdstore.c) and adoption at start (fdstore_adopt.c) are "
         "kept in their own files"),
    ],
    "client": [
        ({"connection", "mappings", "cuda_ipc", "registration",
          "collectives", "training", "async", "admin", "client_int"},
         "libshardd: one object (shardd_client_t, client_int.h) whose "
         "connection, mappings, CUDA IPC layer, registration, collectives, "
         "training requests, async tickets and admin requests are kept in "
         "their own files; they set its last error and free what it holds"),
    ],
    "daemon/kernels": [
        ({"optim_cuda", "optim_elem"},
         "the device update: optim_elem.h is the per-element code that "
         "optim_cuda.cu and its host twin optim_cuda_host.c both compile"),
    ],
}

# The allowed upward edges: hooks an upper layer hands a lower one.
# (type or field, header that declares it, from unit, to unit, what)
HOOKS = [
    ("shardd__dispatch_io", "daemon/rpc/dispatch.h", "daemon/rpc",
     "daemon/net", "send, send_fds, clients, live, partial_bytes, reclaim, "
     "unread_replies: replies leave through the transport"),
    ("shardd__coll_hooks", "daemon/engine/coll.h", "daemon/engine",
     "daemon/rpc", "done, job_quiet, step_begin, step_end: a collective's "
     "end, a job gone quiet, an optimizer step about to change its first "
     "byte and its end (the fd store's step journal)"),
    ("shardd__jobs_released", "daemon/jobs/jobs.h", "daemon/jobs",
     "daemon/rpc", "a job released (what dispatch keeps by job goes)"),
    ("shardd__jobs_ckpt_done", "daemon/jobs/jobs.h", "daemon/jobs",
     "daemon/rpc", "a checkpoint written or failed"),
    ("shardd__jobs_restore_done", "daemon/jobs/jobs.h", "daemon/jobs",
     "daemon/rpc", "a restore done"),
    ("int (*stop)(void *arg)", "daemon/fabric/fabric.h", "daemon/fabric",
     "daemon/engine", "the rendezvous asks whether to give up"),
]

# Daemon modules that may speak the generated wire types (ARCHITECTURE.md
# says why): the dispatcher's folder, and optcodec (an optimizer
# registration's canonical bytes are its packed message).
WIRE = ("daemon/rpc/", "daemon/policy/optcodec")

# Sources built only in some configurations (the Makefile's CUDA_SRC,
# CU_SRC and GLOO_OBJ), by the stamp that says whether they were.
OPTIONAL = [
    (re.compile(r"(^|/)backend_cuda\.c$|\.cu$"), "cuda"),
    (re.compile(r"\.cc$"), "gloo"),
]

ARCH = "ARCHITECTURE.md"


def unit_of(path):
    """The LAYERS key a file belongs to, or None."""
    folder = os.path.dirname(path)
    if folder == "daemon":
        return "daemon/" + stem_of(path)
    while folder:
        if folder in LAYERS:
            return folder
        folder = os.path.dirname(folder)
    return None


def stem_of(path):
    base = os.path.basename(path)
    for ext in (".cu.o", ".o", ".c", ".h", ".cc", ".cu"):
        if base.endswith(ext):
            return base[: -len(ext)]
    return base


def module_of(path):
    return os.path.dirname(path) + "/" + stem_of(path)


def side_of(unit):
    if unit.startswith("daemon/"):
        return "daemon"
    if unit == "client":
        return "client"
    return "shared"


def tree_files():
    out = []
    for top in SOURCE_ROOTS:
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for f in sorted(files):
                if SOURCE_RE.search(f):
                    out.append(os.path.join(folder, f))
    return out


def include_edges(files, findings):
    by_name = {}
    for p in files:
        by_name.setdefault(os.path.basename(p), []).append(p)
    for name, paths in sorted(by_name.items()):
        if name.endswith(".h") and len(paths) > 1:
            findings.append("two headers named %s (%s): includes name a "
                            "header alone" % (name, ", ".join(paths)))
    edges = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                m = re.match(r'\s*#\s*include\s+["<]([^">]+)[">]', line)
                if not m:
                    continue
                inc = m.group(1)
                hits = [p for p in by_name.get(os.path.basename(inc), [])
                        if p == inc or p.endswith("/" + inc)]
                if len(hits) == 1:
                    edges.append((path, hits[0],
                                  "%s:%d includes %s" % (path, n, inc)))
    return edges


def config(build):
    """{'cuda': bool, 'gloo': bool} from BUILD's stamps, or None."""
    cu = glob.glob(os.path.join(build, ".config-cuda*"))
    gl = glob.glob(os.path.join(build, ".gloo*"))
    if len(cu) != 1 or len(gl) != 1:
        return None
    return {"cuda": "-cuda1-" in os.path.basename(cu[0]),
            "gloo": os.path.basename(gl[0]) == ".gloo1"}


def object_of(build, src):
    if src.endswith(".cu"):
        return os.path.join(build, src + ".o")
    return os.path.join(build, re.sub(r"\.(c|cc)$", ".o", src))


def nm(objs, *flags):
    """{object: [symbol lines]} for every object, in one run of nm (-A
    prefixes each line with its file), or None when nm fails."""
    out = subprocess.run(["nm", "-A", *flags, *objs], capture_output=True,
                         text=True)
    if out.returncode != 0:
        return None
    per = {o: [] for o in objs}
    for line in out.stdout.splitlines():
        obj, _, rest = line.partition(":")
        if obj in per:
            per[obj].append(rest)
    return per


def call_edges(build, files, findings):
    cfg = config(build)
    if cfg is None:
        findings.append("%s has no configuration stamp (.config-*, .gloo*): "
                        "build first (make all)" % build)
        return []
    objs = {}
    for src in files:
        if src.endswith(".h"):
            continue
        need = next((k for rx, k in OPTIONAL if rx.search(src)), None)
        if need and not cfg[need]:
            continue
        obj = object_of(build, src)
        if not os.path.exists(obj):
            findings.append("%s: no object %s (build first: the calls are "
                            "checked on every object)" % (src, obj))
        elif os.path.getmtime(obj) < os.path.getmtime(src):
            findings.append("%s: object %s is older than its source "
                            "(rebuild)" % (src, obj))
        else:
            objs[obj] = src
    defined = {}
    undefined = {}
    if not objs:
        return []
    d = nm(sorted(objs), "--defined-only", "--extern-only")
    u = nm(sorted(objs), "--undefined-only")
    if d is None or u is None:
        findings.append("nm cannot read the objects in %s" % build)
        return []
    for obj, src in sorted(objs.items()):
        for line in d[obj]:
            parts = line.split()
            if len(parts) >= 3:
                defined.setdefault(parts[2], src)
        undefined[src] = [line.split()[-1] for line in u[obj] if line.split()]
    edges = []
    for src, syms in undefined.items():
        for sym in syms:
            dst = defined.get(sym)
            if dst and dst != src:
                edges.append((src, dst, "%s calls %s (%s)" % (src, sym, dst)))
    return edges


def wire_uses(files, findings):
    for path in files:
        if not path.startswith("daemon/") or path.startswith(WIRE):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\b(Shardwire__|shardwire__|SHARDWIRE__)", line):
                    findings.append("%s:%d uses a wire type; only %s may"
                                    % (path, n, ", ".join(WIRE)))
                    break


def cycles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check_edges(edges, findings):
    seen = set()
    inside = {}  # unit -> {module: {module: why}}
    for src, dst, why in edges:
        us, ud = unit_of(src), unit_of(dst)
        if us is None or ud is None:
            continue
        ms, md = module_of(src), module_of(dst)
        if ms == md:
            continue
        if us == ud:
            inside.setdefault(us, {}).setdefault(ms, {}).setdefault(md, why)
            continue
        ls, ld = LAYERS[us][0], LAYERS[ud][0]
        bad = None
        if side_of(ud) not in ("shared", side_of(us)):
            bad = "across to the %s" % side_of(ud)
        elif ld >= ls:
            bad = "sideways" if ld == ls else "upward"
        if bad and (us, ud, why) not in seen:
            seen.add((us, ud, why))
            findings.append("%s -> %s goes %s: %s" % (us, ud, bad, why))
    for unit, graph in sorted(inside.items()):
        groups = ONE_OBJECT.get(unit, [])
        for comp in cycles(graph):
            names = {m.rsplit("/", 1)[1] for m in comp}
            if any(names <= g for g, _ in groups):
                continue
            hops = []
            for a in comp:
                for b, why in sorted(graph.get(a, {}).items()):
                    if b in comp:
                        hops.append(why)
            findings.append("cycle in %s between %s: %s" % (
                unit, ", ".join(sorted(names)), "; ".join(hops[:6])))


def check_hooks(findings):
    for name, header, lower, upper, _ in HOOKS:
        if not os.path.exists(header):
            findings.append("hook %s: %s is gone" % (name, header))
            continue
        with open(header, encoding="utf-8", errors="replace") as f:
            if name not in f.read():
                findings.append("hook %s is not declared in %s" % (name, header))
        if unit_of(header) != lower or upper not in LAYERS or \
                LAYERS[upper][0] <= LAYERS[lower][0]:
            findings.append("hook %s: %s -> %s is not an upward edge"
                            % (name, lower, upper))


def arch_sections(text):
    """The first fenced block after '## The tree', and the rows of the
    table after '## The layers'."""
    tree = re.search(r"^## The tree\s*\n.*?^```[^\n]*\n(.*?)^```", text,
                     re.S | re.M)
    table = re.search(r"^## The layers\s*\n(.*?)(?=^## |\Z)", text,
                      re.S | re.M)
    return (tree.group(1) if tree else None,
            table.group(1) if table else None)


def check_architecture(files, findings):
    if not os.path.exists(ARCH):
        findings.append("%s is missing" % ARCH)
        return
    with open(ARCH, encoding="utf-8") as f:
        tree, table = arch_sections(f.read())
    if tree is None:
        findings.append("%s: no '## The tree' section with a ``` block" % ARCH)
    else:
        said = set()
        for line in tree.splitlines():
            words = line.split()
            if not words or not words[0].endswith("/"):
                continue
            folder = words[0].rstrip("/")
            for w in words[1:]:
                if not SOURCE_RE.search(w):
                    break  # the rest of the line describes
                said.add(os.path.join(folder, w))
        real = set(files)
        for p in sorted(real - said):
            findings.append("%s: its tree does not list %s" % (ARCH, p))
        for p in sorted(said - real):
            findings.append("%s: its tree lists %s, which is not there"
                            % (ARCH, p))
    if table is None:
        findings.append("%s: no '## The layers' table" % ARCH)
    else:
        rows = {}
        for line in table.splitlines():
            m = re.match(r"\|\s*(\d+)\s*\|\s*`([^`]+)`", line)
            if m:
                unit = m.group(2).rstrip("/")
                if unit.startswith("daemon/") and unit.count("/") == 1:
                    unit = "daemon/" + stem_of(unit)  # daemon/main.c
                rows[unit] = int(m.group(1))
        for unit, (layer, _) in sorted(LAYERS.items()):
            if unit not in rows:
                findings.append("%s: its layer table has no row for %s"
                                % (ARCH, unit))
            elif rows[unit] != layer:
                findings.append("%s: its layer table gives %s layer %d; the "
                                "check says %d" % (ARCH, unit, rows[unit],
                                                   layer))
        for unit in sorted(set(rows) - set(LAYERS)):
            findings.append("%s: its layer table names %s, which has no layer"
                            % (ARCH, unit))


def main(argv):
    args = list(argv)
    if len(args) >= 2 and args[0] == "--root":
        os.chdir(args[1])
        args = args[2:]
    build = args[0] if args else "build"
    findings = []
    files = tree_files()
    for path in files:
        if unit_of(path) is None:
            findings.append("%s: its folder has no layer in "
                            "scripts/check_layers.py (and %s)" % (path, ARCH))
    wire_uses(files, findings)
    edges = include_edges(files, findings)
    edges += call_edges(build, files, findings)
    check_edges(edges, findings)
    check_hooks(findings)
    check_architecture(files, findings)
    for f in findings:
        print("layers: " + f)
    for name, _, lower, upper, what in HOOKS:
        print("layers: hook %s -> %s: %s (%s)" % (lower, upper, name, what))
    print("layers: %d finding(s) in the includes and calls of %d files "
          "(%d edges)" % (len(findings), len(files), len(edges)))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
