#!/usr/bin/env python3
"""The function-size check fails on a function over its limit and only
then. Each test writes a small tree (daemon/, client/, common/) into a
temporary folder and runs scripts/check_functions.py on it: the repository
itself passes; a 151-line function fails, naming it; a 150-line one, an
initializer table of any length, and braces inside comments and strings do
not count.

Usage: tests/layers/test_check_functions.py [-v]
"""
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "..", ".."))
CHECK = os.path.join(REPO, "scripts", "check_functions.py")


def run_check(root):
    p = subprocess.run([sys.executable, CHECK, "--root", root],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def function(name, lines):
    """A C function of exactly `lines` lines, head to closing brace."""
    body = ["  x += %d;" % i for i in range(lines - 3)]
    return "\n".join(["static int %s(int x)" % name, "{"] + body +
                     ["  return x; }"]) + "\n"


def tree(root, text, path="daemon/util/m.c"):
    for top in ("daemon", "client", "common"):
        os.makedirs(os.path.join(root, top), exist_ok=True)
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


class CheckFunctions(unittest.TestCase):
    def test_repository_passes(self):
        rc, out = run_check(REPO)
        self.assertEqual(rc, 0, out)

    def test_function_over_limit_fails(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, function("long_one", 151), "client/m.c")
            rc, out = run_check(root)
            self.assertEqual(rc, 1, out)
            self.assertIn("client/m.c:1 long_one is 151 lines", out)

    def test_function_at_limit_passes(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, function("just_fits", 150))
            rc, out = run_check(root)
            self.assertEqual(rc, 0, out)
            self.assertIn("0 of 1 function(s)", out)

    def test_tables_comments_strings_do_not_count(self):
        table = "static const int t[] = {\n" + "  1,\n" * 200 + "};\n"
        noise = ('/* { */\nstatic const char *s = "{";\n'
                 "static const char c = '{';\n")
        with tempfile.TemporaryDirectory() as root:
            tree(root, table + noise + function("f", 20) +
                 "struct s {\n" + "  int a;\n" * 200 + "};\n")
            rc, out = run_check(root)
            self.assertEqual(rc, 0, out)
            self.assertIn("0 of 1 function(s)", out)

    def test_namespace_holds_functions(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, "namespace {\n" + function("in_ns", 160) + "}\n",
                 "daemon/fabric/g.cc")
            rc, out = run_check(root)
            self.assertEqual(rc, 1, out)
            self.assertIn("in_ns is 160 lines", out)


if __name__ == "__main__":
    unittest.main()
