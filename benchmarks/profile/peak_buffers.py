"""What is alive at the peak of a compiled program's temporary memory, read from an XLA dump.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*flat_pure.* --xla_dump_hlo_as_text" \
        python -m benchmarks.moe_bench --side jax --steps 1
    python -m benchmarks.profile.peak_buffers /tmp/dump/module_*.jit__flat_pure.*after_optimizations [--top 30]

The argument is the dump's path prefix of one module after optimizations (the files `<prefix>.txt`,
`<prefix>-buffer-assignment.txt` and `<prefix>-buffer-assignment-values.txt`). XLA gives the
temporaries one block whose size is the heap simulation's peak; it does not say what is alive at
that peak. This rebuilds it: the scheduled HLO flattened with each while loop's body and condition
in place of the loop, each value of the temporary block alive from its definition to its last use
(a use inside a loop body keeps a value defined outside alive to the loop's end), the values that
share a loop slot (the loop's operand, its body's parameter and root, its result) joined into one
buffer. It prints the largest sum of live bytes, the instruction where it happens and the buffers
then alive, largest first, with the JAX operation that made each (its op_name).

An estimate: the heap packs buffers with gaps, so XLA's block can be larger (4.44 GiB for the
Qwen3-30B-A3B-shaped step where this finds 4.17), and buffers passed between computations in
other ways than loop slots are followed only through their uses.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys


def parse_computations(text: str) -> tuple[dict, str]:
    """{computation: [(instruction, is_control_flow, called computations, line)]}, entry name."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            cur = head[2]
            comps[cur] = []
            entry = cur if head[1] else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            ins = re.match(r"\s*(ROOT )?%?([\w.\-]+) = ", line)
            if ins:
                calls = re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", line)
                control = re.search(r" (while|conditional|call)\(", line) is not None
                comps[cur].append((ins[2], control, calls, line))
    return comps, entry


def schedule(comps: dict, entry: str) -> tuple[dict, dict, dict]:
    """(time of each instruction and of each `<name>#end`, computation of each instruction,
    {called computation: (calling instruction, its computation)})."""
    order, comp_of, parent = {}, {}, {}
    for c, instructions in comps.items():
        for name, control, calls, _ in instructions:
            comp_of[name] = c
            if control:
                for cc in calls:
                    parent[cc] = (name, c)
    clock = [0]

    def walk(c):
        for name, control, calls, _ in comps[c]:
            order.setdefault(name, clock[0])
            clock[0] += 1
            if control:
                for cc in calls:
                    if cc in comps:
                        walk(cc)
            order[name + "#end"] = clock[0]
            clock[0] += 1

    walk(entry)
    return order, comp_of, parent


def temp_values(assignment: str) -> dict:
    """{value id: (name, bytes, offset, shape)} of the preallocated temporary block."""
    lines = assignment.splitlines()
    start = next(i for i, line in enumerate(lines) if "preallocated-temp" in line)
    out = {}
    for line in lines[start + 1:]:
        m = re.match(r" value: <(\d+) (\S+) @0> \(size=(\d+),offset=(\d+)\): (.*)", line)
        if not m:
            break
        out[int(m[1])] = (m[2], int(m[3]), int(m[4]), m[5])
    return out


def value_records(values_text: str, wanted: dict) -> dict:
    """{value id: (positions, uses, slot keys, op_name)} for the wanted values."""
    out = {}
    for rec in values_text.split("\n<"):
        m = re.match(r"<?(\d+) (\S+) @0>", rec)
        if not m or int(m[1]) not in wanted:
            continue
        head = rec.split(" uses:")[0]
        positions = re.findall(r"^  (\S+(?: \{[\d,]*\})?)$", head, re.M)
        uses = re.findall(r"^  (\S+), operand \d+( \{[\d,]*\})?", rec, re.M)
        op = re.search(r'op_name="([^"]*)"', rec)
        out[int(m[1])] = ([p.split(" ")[0] for p in positions], [u for u, _ in uses],
                          positions + [u + idx for u, idx in uses if idx], op[1] if op else "")
    return out


def peak(prefix: str, top: int = 30, out=None) -> float:
    """Print the peak and the buffers alive there (to `out`, default stdout); returns the peak in GiB."""
    out = out or sys.stdout
    comps, entry = parse_computations(open(prefix + ".txt").read())
    order, comp_of, parent = schedule(comps, entry)
    temp = temp_values(open(prefix + "-buffer-assignment.txt").read())
    records = value_records(open(prefix + "-buffer-assignment-values.txt").read(), temp)

    def kept_until(use, home):
        t, c = order.get(use), comp_of.get(use)
        while c is not None and c != home and c in parent:
            caller, c = parent[c]
            t = order.get(caller + "#end", t)
        return t

    ranges = {}
    for vid, (name, _, _, _) in temp.items():
        positions, uses, _, _ = records.get(vid, ([name], [], [], ""))
        home = comp_of.get(positions[0]) if positions else None
        times = [order[p] for p in positions if p in order] + [order[p + "#end"] for p in positions if p + "#end" in order]
        times += [kept_until(u, home) for u in uses if u in order]
        if times:
            ranges[vid] = (min(times), max(times))
    # loop slots: a while's operand, its body's parameter and root, its condition's parameter, its result
    slot_of = {}
    for c, instructions in comps.items():
        for name, control, calls, line in instructions:
            if control and " while(" in line:
                cond = re.search(r"condition=%?([\w.\-]+)", line)[1]
                body = re.search(r"body=%?([\w.\-]+)", line)[1]
                for comp in (body, cond):
                    for ins, _, _, ln in comps.get(comp, []):
                        if " parameter(0)" in ln or ln.lstrip().startswith("ROOT"):
                            slot_of[ins] = name
                slot_of[name] = name
    group = {}

    def find(x):
        while group.get(x, x) != x:
            x = group[x]
        return x

    for vid, (_, _, keys, _) in records.items():
        for key in keys:
            if " {" in key and key.split(" ", 1)[0] in slot_of:
                a, b = find(("v", vid)), find(("slot", slot_of[key.split(" ", 1)[0]], key.split(" ", 1)[1]))
                if a != b:
                    group[a] = b
    buffers = collections.defaultdict(list)
    for vid in ranges:
        buffers[find(("v", vid))].append(vid)
    delta, spans = collections.Counter(), []
    for members in buffers.values():
        lo, hi = min(ranges[v][0] for v in members), max(ranges[v][1] for v in members)
        size = max((temp[v][1] for v in members if not temp[v][3].startswith("(")), default=0)
        delta[lo] += size
        delta[hi + 1] -= size
        spans.append((lo, hi, size, max(members, key=lambda v: temp[v][1])))
    live, best, at = 0, 0, 0
    for t in sorted(delta):
        live += delta[t]
        if live > best:
            best, at = live, t
    block = max(off + size for _, size, off, _ in temp.values())
    where = next((k for k, v in order.items() if v == at), "?")
    print(f"temporary block {block / 2**30:.3f} GiB; largest sum of live buffers {best / 2**30:.3f} GiB "
          f"at {where} (step {at} of {max(order.values())})", file=out)
    alive = sorted((s for s in spans if s[0] <= at <= s[1]), key=lambda s: -s[2])
    for _, _, size, vid in alive[:top]:
        name, _, _, shape = temp[vid]
        op = records.get(vid, ("", "", "", ""))[3]
        print(f"{size / 2**20:9.1f} MiB  {name:42s} {shape.split('{')[0]:32s} {op[-100:]}", file=out)
    return best / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix", help="a dumped module's path prefix, up to '.txt' (after optimizations)")
    p.add_argument("--top", type=int, default=30, help="buffers to list")
    a = p.parse_args(argv)
    try:
        peak(a.prefix, a.top)
    except OSError as err:
        print(f"peak_buffers: {err}", file=sys.stderr)
        return 2
    except StopIteration:
        print(f"peak_buffers: {a.prefix}-buffer-assignment.txt has no preallocated-temp allocation", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
