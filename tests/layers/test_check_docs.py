#!/usr/bin/env python3
"""The documentation check fails on a pointer that leads nowhere and only
then. Each test writes a small tree (README.md, docs/, a source file) into a
temporary folder and runs scripts/check_docs.py on it: the repository itself
passes; a link to a missing page, a link to a heading the page lacks, and a
comment naming a missing docs/ page each fail, naming the line; links to
headings that exist (punctuation dropped as GitHub drops it), links inside
code blocks and web links pass.

Usage: tests/layers/test_check_docs.py [-v]
"""
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "..", ".."))
CHECK = os.path.join(REPO, "scripts", "check_docs.py")

GOOD_PAGE = """# Several nodes

## A node's daemon killed

See [the daemon](daemon.md#the-daemon) and [above](#a-nodes-daemon-killed).
"""


def run_check(root):
    p = subprocess.run([sys.executable, CHECK, "--root", root],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def tree(root, files):
    base = {
        "README.md": "# x\n\n[nodes](docs/multi-node.md#a-nodes-daemon-killed), "
                     "[web](https://example.org/a#b)\n",
        "docs/multi-node.md": GOOD_PAGE,
        "docs/daemon.md": "# The daemon\n\n```\n[not a link](nowhere.md)\n```\n",
        "daemon/m.c": "/* the bounds: docs/daemon.md */\n",
    }
    base.update(files)
    for path, text in base.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


class CheckDocs(unittest.TestCase):
    def test_repository_passes(self):
        rc, out = run_check(REPO)
        self.assertEqual(rc, 0, out)

    def test_a_tree_whose_pointers_all_lead_somewhere_passes(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, {})
            rc, out = run_check(root)
            self.assertEqual(rc, 0, out)

    def test_a_link_to_a_missing_page_fails(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, {"README.md": "# x\n\nsee [it](docs/security.md)\n"})
            rc, out = run_check(root)
            self.assertEqual(rc, 1, out)
            self.assertIn("README.md:3: link docs/security.md: no file docs/security.md", out)

    def test_a_link_to_a_missing_heading_fails(self):
        with tempfile.TemporaryDirectory() as root:
            tree(root, {"docs/daemon.md": "# The daemon\n\n[x](multi-node.md#restarts)\n"})
            rc, out = run_check(root)
            self.assertEqual(rc, 1, out)
            self.assertIn("docs/daemon.md:3: link multi-node.md#restarts: "
                          "docs/multi-node.md has no heading #restarts", out)

    def test_a_comment_naming_a_missing_page_fails(self):
        with tempfile.TemporaryDirectory() as root:
            missing = "docs/" + "limits.md"  # split, or this file would name it
            tree(root, {"tests/t.py": "# bounds: %s\n" % missing})
            rc, out = run_check(root)
            self.assertEqual(rc, 1, out)
            self.assertIn("tests/t.py:1: names %s, which does not exist" % missing, out)


if __name__ == "__main__":
    unittest.main()
