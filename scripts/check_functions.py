#!/usr/bin/env python3
"""check_functions.py — no function above LIMIT lines in daemon/, client/
and common/ (ARCHITECTURE.md: a function says one thing).

A brace-matching scan of each .c/.cc/.cu file: comments, strings and
character literals are blanked first, then every brace that opens at depth
0 after a ')' (a function body, not an initializer, struct or enum) starts a
function, which ends at its matching brace. A function's length is its
lines from the one holding its name to its closing brace. ALLOW names the
functions allowed over the limit (path:name, with why); it is empty.

Exit status 1 when any function is over, listing each.

Usage: scripts/check_functions.py [--root DIR] [--limit N]
"""
import bisect
import os
import re
import sys

ROOTS = ("daemon", "client", "common")
SOURCE_RE = re.compile(r"\.(c|cc|cu)$")
SKIP_DIRS = {"python", "__pycache__"}
LIMIT = 150
ALLOW = {}  # "path:function": why


def blank(text):
    """text with comments, strings and char literals replaced by spaces
    (newlines kept, so line numbers hold), and preprocessor lines blanked."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":
            # a directive, with its continuation lines
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        at_line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "\n":
            at_line_start = True
        out.append(c)
        i += 1
    return "".join(out)


def functions(text):
    """[(name, first line, last line)] of the function bodies in text."""
    code = blank(text)
    newlines = [i for i, ch in enumerate(code) if ch == "\n"]

    def line_of(pos):
        return bisect.bisect_left(newlines, pos) + 1

    found = []
    depth = 0
    transparent = []  # per open brace: a namespace / extern "C" block?
    start = None
    for m in re.finditer(r"[{}]", code):
        if m.group() == "{":
            # a function's head fits in the 2000 characters before it
            at = max(0, m.start() - 2000)
            head = code[at:m.start()].rstrip()
            # a namespace or extern "C" block holds functions as the file
            # does (the string is blanked, so extern "C" reads 'extern')
            if depth == 0 and re.search(r"(\bnamespace(\s+\w+)?|\bextern)$",
                                        head):
                transparent.append(True)
                continue
            transparent.append(False)
            if depth == 0:
                # a body follows ')' (perhaps with qualifiers after it)
                h = re.sub(r"(\s*\b(const|noexcept|override)\b)+$", "", head)
                start = None
                if h.endswith(")"):
                    # the name: the identifier before the matching '('
                    d, k = 0, len(h) - 1
                    while k >= 0:
                        if h[k] == ")":
                            d += 1
                        elif h[k] == "(":
                            d -= 1
                            if d == 0:
                                break
                        k -= 1
                    nm = re.search(r"([A-Za-z_][\w:~]*)\s*$", h[:k])
                    if nm and nm.group(1) not in ("if", "for", "while",
                                                  "switch", "return"):
                        start = (nm.group(1),
                                 line_of(at + nm.start(1)))
            depth += 1
        else:
            if transparent and transparent.pop():
                continue
            depth = max(depth - 1, 0)
            if depth == 0 and start:
                found.append((start[0], start[1],
                              line_of(m.start())))
                start = None
    return found


def main(argv):
    args = list(argv)
    limit = LIMIT
    while args:
        if args[0] == "--root" and len(args) > 1:
            os.chdir(args[1])
            args = args[2:]
        elif args[0] == "--limit" and len(args) > 1:
            limit = int(args[1])
            args = args[2:]
        else:
            print("usage: check_functions.py [--root DIR] [--limit N]")
            return 2
    over = []
    count = 0
    for top in ROOTS:
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for f in sorted(files):
                if not SOURCE_RE.search(f):
                    continue
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for name, a, b in functions(fh.read()):
                        count += 1
                        lines = b - a + 1
                        if lines > limit and "%s:%s" % (path, name) not in ALLOW:
                            over.append((path, a, name, lines))
    for path, a, name, lines in over:
        print("functions: %s:%d %s is %d lines (over %d)"
              % (path, a, name, lines, limit))
    print("functions: %d of %d function(s) over %d lines"
          % (len(over), count, limit))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
