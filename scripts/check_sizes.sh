#!/usr/bin/env bash
# Lists the functions over MAX_FUNCTION lines (default 150) and the files over MAX_FILE lines
# (default 800) in the C++ sources under the given paths (default: src/), largest first.
#
#   scripts/check_sizes.sh                 # the whole of src/
#   scripts/check_sizes.sh src/cli         # one folder
#   MAX_FUNCTION=100 scripts/check_sizes.sh
#
# A function is a brace-matched body whose opening brace follows a parameter list `)` (with any
# of const, noexcept, override, final, mutable, a trailing `-> Type`, or a constructor's
# initializer list in between) outside any other function body: free functions, member functions
# defined in a class, constructors, and lambdas at namespace scope (e.g. a command's setup lambda
# in SY_REGISTER_COMMAND). Lambdas and local classes inside a function count as part of it.
# Comments, string and character literals (raw strings included) are blanked before matching,
# and `if`/`for`/`while`/`switch`/`catch` bodies are never taken for functions. A function's
# length is from the line of its name to its closing brace.
# Exit status: 0 when nothing is over, 1 otherwise (so CI could use it), 2 on bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_FUNCTION="${MAX_FUNCTION:-150}" MAX_FILE="${MAX_FILE:-800}" exec python3 - "${@:-src}" <<'EOF'
import os, re, sys

MAX_FUNCTION = int(os.environ["MAX_FUNCTION"])
MAX_FILE = int(os.environ["MAX_FILE"])
EXTS = (".cc", ".h", ".cpp", ".hpp", ".cu", ".cuh")


def blank(text):
    """Comments and literals replaced by spaces (newlines kept, so line numbers hold)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i-1].isalnum() or text[i-1] == "_")):
            m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:])
            if not m:
                out.append(c); i += 1; continue
            end = ")" + m.group(1) + '"'
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif c in "\"'":
            # A ' between digits is a digit separator (1'000), not a character literal.
            if c == "'" and i > 0 and text[i-1].isalnum() and i + 1 < n and text[i+1].isalnum():
                out.append(" "); i += 1; continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i)); i = j
        else:
            out.append(c); i += 1
    return "".join(out)


CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof",
           "static_assert", "requires", "noexcept"}
TAIL = re.compile(r"(\s*(const|noexcept(\s*\([^()]*\))?|override|final|mutable|volatile|&&?|"
                  r"->\s*[\w:<>,\s\*&]+?))*\s*$")


def opens_function(head):
    """`head` is the code between the previous ; { } and this {: is this brace a function body?"""
    h = re.sub(r"\s+", " ", head).strip()
    if not h or h.startswith("#"):
        return None
    # Constructor initializer list: `Name(args) : a_(x), b_{y}` -- cut at the ` : ` after `)`.
    m = re.search(r"\)\s*(?:noexcept\s*)?:(?!:)", h)
    if m:
        h = h[: m.start() + 1]
    h = TAIL.sub("", h) if not h.endswith(")") else h
    if not h.endswith(")"):
        return None
    # The name before the parameter list's matching '('.
    depth = 0
    for k in range(len(h) - 1, -1, -1):
        if h[k] == ")":
            depth += 1
        elif h[k] == "(":
            depth -= 1
            if depth == 0:
                break
    else:
        return None
    before = h[:k].rstrip()
    if before.endswith("]"):  # a lambda: [captures](params)
        return "lambda"
    m = re.search(r"([~\w:]+(?:<[^<>]*>)?|operator\s*\S+)\s*$", before)
    if not m:
        return None
    name = m.group(1)
    last = name.split("::")[-1]
    if last in CONTROL or name in CONTROL:
        return None
    # A macro call ending in a statement-like `)` followed by `{` (e.g. SY_REGISTER_COMMAND(...)
    # never is: it ends in ';'). An initializer `Type name(args) {` does not occur in C++.
    return name


def scan(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    code = blank(text)
    # Preprocessor lines (with their continuations) are not code the braces belong to.
    code = re.sub(r"(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
                  lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)
    funcs = []
    stack = []  # per open brace: None, or (name, start line) of a function body
    in_function = 0
    last = 0  # index after the previous ; { }
    line_of = lambda idx: code.count("\n", 0, idx) + 1
    paren = 0
    for i, c in enumerate(code):
        if c == "(":
            paren += 1
        elif c == ")":
            paren = max(0, paren - 1)
        elif c == ";" and paren == 0:
            last = i + 1
        elif c == "{":
            kind = None
            if in_function == 0:
                head = code[last:i]
                name = opens_function(head)
                if name is not None:
                    # The function starts at the line of its first non-blank head character.
                    start = last + (len(head) - len(head.lstrip()))
                    kind = (name, line_of(start))
                    in_function += 1
            stack.append(kind)
            last = i + 1
        elif c == "}":
            if stack:
                kind = stack.pop()
                if kind is not None:
                    in_function -= 1
                    name, start = kind
                    funcs.append((name, start, line_of(i)))
            last = i + 1
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    return lines, funcs


def main(roots):
    files = []
    for root in roots:
        if os.path.isfile(root):
            files.append(root)
            continue
        if not os.path.isdir(root):
            print(f"check_sizes: {root}: no such file or folder", file=sys.stderr)
            return 2
        for d, _, names in os.walk(root):
            files += [os.path.join(d, f) for f in names if f.endswith(EXTS)]
    long_funcs, long_files = [], []
    for path in sorted(files):
        lines, funcs = scan(path)
        if lines > MAX_FILE:
            long_files.append((lines, path))
        for name, start, end in funcs:
            length = end - start + 1
            if length > MAX_FUNCTION:
                long_funcs.append((length, f"{path}:{start}", name))
    print(f"functions over {MAX_FUNCTION} lines: {len(long_funcs)}")
    for length, where, name in sorted(long_funcs, reverse=True):
        print(f"  {length:5d}  {where}  {name}")
    print(f"files over {MAX_FILE} lines: {len(long_files)}")
    for lines, path in sorted(long_files, reverse=True):
        print(f"  {lines:5d}  {path}")
    return 1 if long_funcs or long_files else 0


sys.exit(main(sys.argv[1:]))
EOF
