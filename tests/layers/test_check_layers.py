#!/usr/bin/env python3
"""The layer check fails on what it is there to catch. Each test copies the
sources, ARCHITECTURE.md and the built objects (BUILD, default build) into a
temporary tree, breaks one thing, and runs scripts/check_layers.py on the
copy: the untouched copy passes; a cycle between two files of one folder, an
upward include, an upward call through a hand-written declaration, a
missing object, a file outside every layer and an ARCHITECTURE.md that
disagrees with the tree each fail it, naming what they broke.

Usage: tests/layers/test_check_layers.py [-v]   (from the repository root,
after make; BUILD=build/check for the sanitizer build)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "..", ".."))
BUILD = os.environ.get("BUILD", "build")
CHECK = os.path.join(REPO, "scripts", "check_layers.py")
SOURCES = ("include", "common", "client", "daemon")


def copy_tree(dst):
    for top in SOURCES:
        shutil.copytree(os.path.join(REPO, top), os.path.join(dst, top),
                        ignore=shutil.ignore_patterns("python", "__pycache__"))
    shutil.copy2(os.path.join(REPO, "ARCHITECTURE.md"), dst)
    src_build = os.path.join(REPO, BUILD)
    for name in os.listdir(src_build):
        if name.startswith((".config-", ".gloo")):
            os.makedirs(os.path.join(dst, BUILD), exist_ok=True)
            shutil.copy2(os.path.join(src_build, name),
                         os.path.join(dst, BUILD, name))
    for top in SOURCES:
        for folder, _, files in os.walk(os.path.join(src_build, top)):
            for f in files:
                if f.endswith(".o"):
                    rel = os.path.relpath(os.path.join(folder, f), REPO)
                    os.makedirs(os.path.join(dst, os.path.dirname(rel)),
                                exist_ok=True)
                    shutil.copy2(os.path.join(REPO, rel), os.path.join(dst, rel))


def run_check(root):
    p = subprocess.run([sys.executable, CHECK, "--root", root, BUILD],
                       capture_output=True, text=True)
    findings = [l for l in p.stdout.splitlines()
                if l.startswith("layers: ") and " finding(s) " not in l
                and not l.startswith("layers: hook ")]
    return p.returncode, findings, p.stdout + p.stderr


def append_keeping_mtime(path, text):
    """Appends text to path, its mtime kept, so that the object built from
    it does not look stale: the finding must come from the text alone."""
    st = os.stat(path)
    with open(path, "a") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


class CheckLayersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.isdir(os.path.join(REPO, BUILD, "daemon")):
            raise unittest.SkipTest("%s is not built (make all)" % BUILD)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="layers-")
        self.root = os.path.join(self.tmp, "tree")
        os.makedirs(self.root)
        copy_tree(self.root)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def p(self, *parts):
        return os.path.join(self.root, *parts)

    def assertFailsWith(self, pattern):
        rc, findings, out = run_check(self.root)
        self.assertEqual(rc, 1, out)
        self.assertTrue(findings, out)
        for f in findings:
            self.assertRegex(f, pattern, out)

    def test_the_untouched_copy_passes(self):
        rc, findings, out = run_check(self.root)
        self.assertEqual(rc, 0, out)
        self.assertEqual(findings, [], out)

    def test_a_cycle_between_two_files_of_one_folder_fails(self):
        append_keeping_mtime(self.p("daemon", "util", "log.c"),
                             '\n#include "map.h"\n')
        append_keeping_mtime(self.p("daemon", "util", "map.c"),
                             '\n#include "log.h"\n')
        self.assertFailsWith(r"cycle in daemon/util between log, map: "
                             r".*log\.c:\d+ includes map\.h")

    def test_a_cycle_joined_by_a_file_outside_its_group_fails(self):
        # status.c is not one of the dispatcher's files: a call back into
        # the table from it is a cycle the allow-list does not cover
        append_keeping_mtime(self.p("daemon", "rpc", "status.c"),
                             '\n#include "dispatch_int.h"\n')
        self.assertFailsWith(r"cycle in daemon/rpc between .*status")

    def test_an_upward_include_fails(self):
        append_keeping_mtime(self.p("daemon", "registry", "buffer.c"),
                             '\n#include "jobs.h"\n')
        self.assertFailsWith(r"daemon/registry -> daemon/jobs goes upward: "
                             r"daemon/registry/buffer\.c:\d+ includes jobs\.h")

    def test_the_daemon_including_the_client_fails(self):
        append_keeping_mtime(self.p("daemon", "util", "log.c"),
                             '\n#include "fmt.h"\n')
        self.assertFailsWith(r"daemon/util -> client goes across to the client")

    @unittest.skipUnless(shutil.which("cc"), "no C compiler")
    def test_an_upward_call_through_a_hand_written_declaration_fails(self):
        # a call only the objects show (as if buffer.c declared it by hand):
        # an object with the call linked into buffer.o, no source changed
        obj = self.p(BUILD, "daemon", "registry", "buffer.o")
        stub = self.p("up.c")
        with open(stub, "w") as f:
            f.write("void shardd__jobs_free(void *j);\n"
                    "void layers_test_up(void);\n"
                    "void layers_test_up(void) { shardd__jobs_free(0); }\n")
        extra = self.p("up.o")
        subprocess.run(["cc", "-c", stub, "-o", extra], check=True)
        subprocess.run(["ld", "-r", "-o", obj + ".new", obj, extra], check=True)
        os.replace(obj + ".new", obj)
        self.assertFailsWith(r"daemon/registry -> daemon/jobs goes upward: "
                             r".*buffer\.(c|o) calls shardd__jobs_free")

    def test_a_missing_object_fails(self):
        os.remove(self.p(BUILD, "daemon", "util", "map.o"))
        self.assertFailsWith(r"daemon/util/map\.c: no object ")

    def test_an_object_older_than_its_source_fails(self):
        os.utime(self.p("daemon", "util", "map.c"), None)
        obj = self.p(BUILD, "daemon", "util", "map.o")
        os.utime(obj, (1, 1))
        self.assertFailsWith(r"daemon/util/map\.c: object .* is older than "
                             r"its source")

    def test_no_build_at_all_fails(self):
        shutil.rmtree(self.p(BUILD))
        rc, findings, out = run_check(self.root)
        self.assertEqual(rc, 1, out)
        self.assertIn("build first", out)

    def test_a_file_in_a_folder_without_a_layer_fails(self):
        os.makedirs(self.p("daemon", "extra"))
        with open(self.p("daemon", "extra", "thing.h"), "w") as f:
            f.write("/* nothing */\n")
        rc, findings, out = run_check(self.root)
        self.assertEqual(rc, 1, out)
        self.assertTrue(any(re.search(r"daemon/extra/thing\.h: its folder "
                                      r"has no layer", f) for f in findings),
                        out)

    def test_an_architecture_tree_missing_a_file_fails(self):
        path = self.p("ARCHITECTURE.md")
        with open(path) as f:
            text = f.read()
        text2 = re.sub(r"(daemon/util/[^\n]*?) map\.c", r"\1", text)
        self.assertNotEqual(text, text2)
        with open(path, "w") as f:
            f.write(text2)
        self.assertFailsWith(r"ARCHITECTURE\.md: its tree does not list "
                             r"daemon/util/map\.c")

    def test_an_architecture_tree_listing_a_file_not_there_fails(self):
        path = self.p("ARCHITECTURE.md")
        with open(path) as f:
            text = f.read()
        text2 = re.sub(r"(daemon/util/\s+)", r"\1gone.c ", text, count=1)
        self.assertNotEqual(text, text2)
        with open(path, "w") as f:
            f.write(text2)
        self.assertFailsWith(r"ARCHITECTURE\.md: its tree lists "
                             r"daemon/util/gone\.c, which is not there")

    def test_an_architecture_layer_table_disagreeing_fails(self):
        path = self.p("ARCHITECTURE.md")
        with open(path) as f:
            text = f.read()
        text2 = re.sub(r"\| \d+ \| `daemon/engine/`", "| 3 | `daemon/engine/`",
                       text)
        self.assertNotEqual(text, text2)
        with open(path, "w") as f:
            f.write(text2)
        self.assertFailsWith(r"ARCHITECTURE\.md: its layer table gives "
                             r"daemon/engine layer 3; the check says \d+")


if __name__ == "__main__":
    unittest.main()
