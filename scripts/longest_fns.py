#!/usr/bin/env python3
"""The longest Rust functions under a folder (issue 41's "ten longest functions").

Counts the lines from a `fn` line to its matching closing brace, ignoring braces in
strings, chars and comments well enough for this codebase. Usage:
    python3 scripts/longest_fns.py [src] [N]
"""
import os
import re
import sys

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def strip(line, state):
    """Drops comments and string contents; `state` carries a block comment or raw string across lines."""
    out, i = [], 0
    while i < len(line):
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"], i = False, j + 2
            continue
        if state["str"]:
            if line[i] == "\\":
                i += 2
                continue
            if line[i] == '"':
                state["str"] = False
            i += 1
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"], i = True, i + 2
            continue
        if c == '"':
            state["str"], i = True, i + 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    state = {"block": False, "str": False}
    clean = [strip(l, state) for l in lines]
    found = []
    for n, l in enumerate(clean):
        m = FN.match(l)
        if not m:
            continue
        depth, started = 0, False
        for k in range(n, len(clean)):
            for ch in clean[k]:
                if ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and not started and depth == 0:
                    break
            else:
                if started and depth == 0:
                    found.append((k - n + 1, path, n + 1, m.group(6)))
                    break
                continue
            break
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "src"
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    allf = []
    for d, _, files in os.walk(root):
        for name in files:
            if name.endswith(".rs"):
                allf += functions(os.path.join(d, name))
    allf.sort(key=lambda t: -t[0])
    for length, path, line, name in allf[:most]:
        print(f"{length:5d}  {path}:{line}  {name}")


if __name__ == "__main__":
    main()
