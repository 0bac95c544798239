#!/usr/bin/env python3
"""check_layers.py — fails when a daemon module includes or calls upward.

ARCHITECTURE.md gives the layers; LAYERS below is the same table, and the
test keeps the two honest. Two graphs are checked, between the modules of
daemon/ (a module is one .c/.h pair, or the files of one package: the
engine's coll*.c, the registry's registry/buffer/optimizer, the
checkpoint's ckfile/manifest/checkpoint/restore, the dispatcher's
dispatch/reply/session/register/training/buckets/ckpt_*):

  includes  every #include "x.h" in daemon/*.{c,h,cc,cu}
  calls     every undefined symbol of an object in BUILD/daemon/*.o that
            another daemon object defines (nm), so a call made through a
            declaration written by hand is caught too

An edge must go from a higher layer to a lower one, or stay inside its
module; any other edge is reported with the files that make it, and so is a
file no layer lists, and a use of the generated wire types (Shardwire__*)
outside the modules WIRE_MODULES names. Exit status 1 on any finding.

Usage: scripts/check_layers.py [BUILD]   (default build; without objects
only the includes are checked)
"""
import os
import re
import subprocess
import sys

# module -> layer; a module may use modules of lower layers only.
LAYERS = {
    # leaves: no daemon module below them
    "log": 0, "map": 0, "optspec": 0, "jobspec": 0, "sdnotify": 0,
    "fabric": 0, "hostdev": 0,
    "dtype": 1, "opts": 1, "cli": 2,
    # optimizer math, host and device
    "optim": 2,
    # memory
    "backend": 3,
    # what the daemon owns
    "registry": 4,
    # core use cases over the registry
    "validate": 5, "optcodec": 5, "access": 5,
    "optreg": 6,
    "checkpoint": 7,
    # the collective engine
    "coll": 8,
    # the fd store's descriptions of jobs (beside the engine, told of its
    # steps through dispatch)
    "fdstore": 8,
    # job lifetime (asks the engine whether a job is busy, frees its state)
    "jobs": 9,
    # reports
    "status": 10,
    # requests -> core
    "dispatch": 11,
    # transport
    "server": 12,
    # composition root
    "main": 13,
}

# files -> module, where the module is not the file's stem
PACKAGES = {
    "dispatch_int": "dispatch", "reply": "dispatch",
    "ckpt_operator": "dispatch", "ckpt_collective": "dispatch",
    "buckets": "dispatch", "register": "dispatch", "training": "dispatch",
    "session": "dispatch",
    "coll_int": "coll", "coll_work": "coll", "coll_bulk": "coll",
    "coll_fabric": "coll", "coll_submit": "coll", "coll_phase": "coll",
    "coll_run": "coll", "coll_members": "coll", "coll_exchange": "coll",
    "coll_join": "coll",
    "registry_int": "registry", "buffer": "registry", "optimizer": "registry",
    "areas": "registry",
    "framebudget": "server", "server_int": "server", "reads": "server",
    "replybudget": "server",
    "ckfile": "checkpoint", "manifest": "checkpoint", "restore": "checkpoint",
    "restore_int": "checkpoint", "restore_plan": "checkpoint",
    "backend_host": "backend", "backend_cuda": "backend",
    "fabric_gloo": "fabric", "fabric_stub": "fabric",
    "optim_elem": "optim", "optim_cuda": "optim", "optim_cuda_host": "optim",
}

DAEMON = "daemon"


def module_of(path):
    stem = os.path.basename(path)
    for ext in (".pb-c.h", ".cu.o", ".c", ".h", ".cc", ".cu", ".o"):
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
            break
    return PACKAGES.get(stem, stem)


def daemon_files():
    for name in sorted(os.listdir(DAEMON)):
        if re.search(r"\.(c|h|cc|cu)$", name):
            yield os.path.join(DAEMON, name)


def include_edges(findings):
    local = {os.path.basename(p) for p in daemon_files()}
    edges = []
    for path in daemon_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                # "x.h" and <x.h> alike: -Idaemon makes both reach daemon/
                m = re.match(r'\s*#\s*include\s+["<]([^">]+)[">]', line)
                if m and os.path.basename(m.group(1)) in local:
                    edges.append((module_of(path), module_of(m.group(1)),
                                  "%s:%d includes %s" % (path, n, m.group(1))))
    return edges


# Modules that may speak the generated wire types (ARCHITECTURE.md says
# why each one does); any other use is a finding.
WIRE_MODULES = {"dispatch", "optcodec", "status"}


def wire_uses(findings):
    for path in daemon_files():
        if module_of(path) in WIRE_MODULES:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\b(Shardwire__|shardwire__|SHARDWIRE__)", line):
                    findings.append("%s:%d uses a wire type; only %s may"
                                    % (path, n, ", ".join(sorted(WIRE_MODULES))))
                    break


def nm(obj, *flags):
    out = subprocess.run(["nm", *flags, obj], capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else []


def call_edges(build):
    objdir = os.path.join(build, DAEMON)
    if not os.path.isdir(objdir):
        return None
    objs = sorted(os.path.join(objdir, o) for o in os.listdir(objdir)
                  if o.endswith(".o"))
    if not objs:
        return None
    defined = {}
    for o in objs:
        for line in nm(o, "--defined-only", "--extern-only"):
            parts = line.split()
            if len(parts) >= 3:
                defined.setdefault(parts[2], o)
    edges = []
    for o in objs:
        for line in nm(o, "--undefined-only"):
            sym = line.split()[-1]
            target = defined.get(sym)
            if target and target != o:
                edges.append((module_of(o), module_of(target),
                              "%s calls %s (%s)" % (o, sym, target)))
    return edges


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    findings = []
    for path in daemon_files():
        if module_of(path) not in LAYERS:
            findings.append("%s: module %s has no layer in "
                            "scripts/check_layers.py (and ARCHITECTURE.md)"
                            % (path, module_of(path)))
    wire_uses(findings)
    edges = include_edges(findings)
    calls = call_edges(build)
    if calls is not None:
        edges += calls
    seen = set()
    for src, dst, why in edges:
        if src == dst or src not in LAYERS or dst not in LAYERS:
            continue
        if LAYERS[src] <= LAYERS[dst] and (src, dst, why) not in seen:
            seen.add((src, dst, why))
            findings.append("%s -> %s goes %s: %s" % (
                src, dst, "sideways" if LAYERS[src] == LAYERS[dst] else "upward",
                why))
    for f in findings:
        print("layers: " + f)
    what = "includes and calls" if calls is not None else "includes"
    print("layers: %d finding(s) in the %s of %d daemon files" %
          (len(findings), what, len(list(daemon_files()))))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
