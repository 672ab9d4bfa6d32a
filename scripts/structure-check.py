#!/usr/bin/env python3
"""Checks forgepool's structural invariants (ARCHITECTURE.md, "Structural invariants"):

- no production source file over 700 lines (unit-test modules at the end excluded);
- no function over 100 lines, except plain tables (a function whose body is one literal);
- lapin and deadpool-lapin only in AMQP modules; bollard only in the worker's Docker module;
- `engine/machine.rs` does no I/O;
- no circle of files through `crate::` or `super::` paths within a crate;
- the worker and the dispatcher do not depend on each other.

Prints every breach and exits 1 when there is one.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE = 700
MAX_FN = 100
failures = []


def sources():
    for base in ["src"] + [os.path.join("crates", c, "src") for c in sorted(os.listdir(os.path.join(ROOT, "crates")))]:
        for folder, _, files in os.walk(os.path.join(ROOT, base)):
            for name in sorted(files):
                if name.endswith(".rs"):
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


def production_lines(text):
    """The lines before a trailing `#[cfg(test)] mod ... {` block; a file that is a test module
    (`tests.rs`, or one only compiled for tests) has none."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*mod \w+ \{", lines[i + 1]):
            return lines[:i]
    return lines


def is_test_file(path):
    return path.endswith("/tests.rs") or path.endswith("/fake.rs")


def functions(lines):
    """(name, first line, length) of every fn, by brace matching from its signature."""
    found = []
    for i, line in enumerate(lines):
        match = re.match(r"\s*(pub(\([^)]*\))? )?(async )?(const )?(unsafe )?fn (\w+)", line)
        if not match:
            continue
        depth, started, end = 0, False, None
        for j in range(i, len(lines)):
            code = re.sub(r'"([^"\\]|\\.)*"', '""', lines[j].split("//")[0])
            for ch in code:
                if ch == "{":
                    depth += 1
                    started = True
                elif ch == "}":
                    depth -= 1
            if started and depth == 0:
                end = j
                break
            if not started and code.rstrip().endswith(";"):
                break
        if end is not None:
            found.append((match.group(6), i + 1, end - i + 1, lines[i:end + 1]))
    return found


def is_table(body):
    """A plain table: straight-line declarations (a struct or `json!` literal of definitions)
    with no control flow at all."""
    text = strip_comments("\n".join(body[1:-1]))
    text = re.sub(r'"([^"\\]|\\.)*"', '""', text)
    return not re.search(r"\b(if|for|while|loop|match)\b|\?", text)


def strip_comments(text):
    return "\n".join(line.split("//")[0] if line.lstrip().startswith("//") else line for line in text.split("\n"))


crate_of = lambda path: path.split("/")[1] if path.startswith("crates/") else "forgepool"
files = list(sources())
texts = {path: open(os.path.join(ROOT, path)).read() for path in files}

for path in files:
    text = texts[path]
    if is_test_file(path):
        continue
    lines = production_lines(text)
    if len(lines) > MAX_FILE:
        failures.append(f"{path}: {len(lines)} production lines, over {MAX_FILE}")
    for name, line, length, body in functions(lines):
        if length > MAX_FN and not is_table(body):
            failures.append(f"{path}:{line}: fn {name} has {length} lines, over {MAX_FN}")
    production = strip_comments("\n".join(lines))
    if re.search(r"\b(lapin|deadpool_lapin)::", production) and "/amqp" not in path:
        failures.append(f"{path}: uses lapin outside an AMQP module")
    if re.search(r"\bbollard::", production) and not path.startswith("crates/worker/src/docker"):
        failures.append(f"{path}: uses bollard outside the worker's Docker module")
    if path == "crates/worker/src/engine/machine.rs" and re.search(r"\b(tokio|std::fs|std::process|std::net|std::io)::", production):
        failures.append(f"{path}: the run machine does I/O")
    if crate_of(path) == "worker" and re.search(r"\bdispatcher::", production):
        failures.append(f"{path}: the worker depends on the dispatcher")
    if crate_of(path) == "dispatcher" and re.search(r"\bworker::", production):
        failures.append(f"{path}: the dispatcher depends on the worker")

# Circles of files: an edge A -> B when A names `crate::b::...` (B's module file).
def module_file(crate_root, parts):
    for n in range(len(parts), 0, -1):
        base = os.path.join(crate_root, *parts[:n])
        for candidate in (base + ".rs", os.path.join(base, "mod.rs")):
            if candidate in texts:
                return candidate
    return None


edges = {}
for path in files:
    if is_test_file(path):
        continue
    crate_root = "src" if path.startswith("src/") else "/".join(path.split("/")[:3])
    production = strip_comments("\n".join(production_lines(texts[path])))
    targets = set()
    for match in re.finditer(r"\bcrate::((?:\w+::)*\w+)", production):
        target = module_file(crate_root, match.group(1).split("::"))
        if target and target != path:
            targets.add(target)
    # `use crate::{a, b::c}` groups.
    for group in re.finditer(r"use crate::\{([^}]*)\}", production):
        for item in group.group(1).split(","):
            target = module_file(crate_root, item.strip().split("::"))
            if target and target != path:
                targets.add(target)
    # `super::x::...` and `use super::{a, b::c}`: paths from the parent module.
    inner = path[len(crate_root) + 1:-3].split("/")
    if inner[-1] == "mod":
        inner = inner[:-1]
    parent = inner[:-1] if inner[-1] not in ("lib", "main") else []
    names = [m.group(1) for m in re.finditer(r"\bsuper::((?:\w+::)*\w+)", production)]
    for group in re.finditer(r"use super::\{([^}]*)\}", production):
        names += [item.strip() for item in group.group(1).split(",") if item.strip()]
    for name in names:
        target = module_file(crate_root, parent + name.split("::"))
        if target and target != path:
            targets.add(target)
    edges[path] = targets


def find_cycle():
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


cycle = find_cycle()
if cycle:
    failures.append("a circle of files: " + " -> ".join(cycle))

for failure in failures:
    print(failure)
if failures:
    sys.exit(1)
print(f"structure: {len(files)} files checked; every invariant holds")
