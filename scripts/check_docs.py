#!/usr/bin/env python3
"""check_docs.py — the documentation's cross-references lead somewhere.

README.md is a short entry and the rest lives in docs/*.md, one topic a
file, so the pages point at each other, and code, tests and scripts point
at them in comments ("docs/security.md"). This fails when such a pointer
leads nowhere:

- a relative Markdown link ([text](path#anchor)) of README.md,
  ARCHITECTURE.md or docs/*.md whose file does not exist, or whose anchor
  is no heading of that file (GitHub's slug: lower case, punctuation
  dropped, spaces to hyphens);
- a "docs/<name>.md" named in any tracked-looking text file of the tree
  (sources, tests, scripts, units, examples, bench) that does not exist.

Exit status 1 listing each, 0 when none.

Usage: scripts/check_docs.py [--root DIR]
"""
import os
import re
import sys

PAGES_TOP = ("README.md", "ARCHITECTURE.md")
SKIP_DIRS = {".git", "build", "__pycache__", "results"}
TEXT_RE = re.compile(r"\.(c|cc|cu|h|py|sh|in|md|proto|socket|service|txt)$|^Makefile$|^run$")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOC_NAME_RE = re.compile(r"\bdocs/[A-Za-z0-9_-]+\.md\b")


def slug(heading):
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def headings(path):
    """The anchors of a Markdown file's headings (outside code blocks)."""
    out, code = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                code = not code
            elif not code and re.match(r"#{1,6} ", line):
                out.add(slug(line.split(" ", 1)[1]))
    return out


def pages(root):
    out = [p for p in PAGES_TOP if os.path.exists(os.path.join(root, p))]
    d = os.path.join(root, "docs")
    if os.path.isdir(d):
        out += sorted("docs/" + n for n in os.listdir(d) if n.endswith(".md"))
    return out


def link_findings(root):
    found, cache = [], {}
    for page in pages(root):
        with open(os.path.join(root, page), encoding="utf-8") as f:
            text = f.read()
        code = False
        for n, line in enumerate(text.split("\n"), 1):
            if line.startswith("```"):
                code = not code
            if code:
                continue
            for m in LINK_RE.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue  # http:, mailto:
                path, _, anchor = target.partition("#")
                full = (os.path.normpath(os.path.join(root, os.path.dirname(page), path))
                        if path else os.path.join(root, page))
                if not os.path.exists(full):
                    found.append("%s:%d: link %s: no file %s"
                                 % (page, n, target, os.path.relpath(full, root)))
                    continue
                if anchor and full.endswith(".md"):
                    if full not in cache:
                        cache[full] = headings(full)
                    if anchor not in cache[full]:
                        found.append("%s:%d: link %s: %s has no heading #%s"
                                     % (page, n, target, os.path.relpath(full, root), anchor))
    return found


def name_findings(root):
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS
                         and (d == ".ci" or not d.startswith(".")))
        for name in sorted(files):
            if not TEXT_RE.search(name):
                continue
            path = os.path.join(top, name)
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().split("\n")
            except (UnicodeDecodeError, OSError):
                continue
            for n, line in enumerate(lines, 1):
                for m in DOC_NAME_RE.finditer(line):
                    if not os.path.exists(os.path.join(root, m.group(0))):
                        found.append("%s:%d: names %s, which does not exist"
                                     % (os.path.relpath(path, root), n, m.group(0)))
    return found


def main(argv):
    root = "."
    if len(argv) == 2 and argv[0] == "--root":
        root = argv[1]
    elif argv:
        print(__doc__.strip().split("\n")[-1], file=sys.stderr)
        return 2
    found = link_findings(root) + name_findings(root)
    for f in found:
        print("docs: " + f)
    print("docs: %d finding(s) in the links of %d page(s) and the docs/ names of the tree"
          % (len(found), len(pages(root))))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
