"""The PTX parser: one kernel's `.entry` body as a flat list of (predicate, opcode, operands).

`Program(ptx)` reads the first `.entry` of a PTX module: its parameters (the CuTe DSL declares
every one as `.param .align A .b8 NAME[SIZE]`; `params` lists (NAME, SIZE) in order), its
instructions (`instrs`: `(pred, op, args)`, pred `None` or `(negated, register)`, op the full
dotted opcode, args the operand strings split at top-level commas, `{...}` vectors and `[...]`
addresses kept whole) and its labels (`labels`: name -> instruction index). Comments, `.reg` and
`.pragma` lines and closing braces are dropped.

`InlineAsmProgram` first flattens the nested `{ ... }` scopes the DSL's inline-asm blocks open
(mbarrier waits and the like), renaming their block-local labels (LAB_WAIT, DONE) per block.
`named_barriers(prog)` rewrites `bar.sync` / `barrier.sync` to `NBAR`, which `HopperCTA` runs as
a named barrier (id, thread count) instead of the base CTA's CTA-wide barrier.

Not modelled: more than one kernel per module, device functions and `call`, `.local` / `.const`
declarations, initialized globals, `.maxnreg` and the other directives (ignored).
"""

import re

NBAR = "ptxsim.nbar"  # the private opcode named_barriers() gives bar.sync (HopperCTA runs it)


class Program:
    """One kernel's parameters, instructions and labels (see the module docstring)."""

    def __init__(self, ptx: str):
        body = ptx[ptx.index(".entry"):]
        self.params = re.findall(r"\.param\s+\.align\s+\d+\s+\.b8\s+(\w+)\[(\d+)\]", body)
        body = body[body.index("{") + 1:]
        lines = []
        for raw in body.split("\n"):
            line = raw.split("//")[0].strip()
            if not line or line.startswith(".reg") or line.startswith(".pragma") or line == "}":
                continue
            lines.append(line)
        text = " ".join(lines)
        self.instrs = []
        self.labels = {}
        for stmt in text.split(";"):
            stmt = stmt.strip()
            while True:
                m = re.match(r"^(\$?[\w$]+):\s*(.*)$", stmt)
                if not m:
                    break
                self.labels[m.group(1)] = len(self.instrs)
                stmt = m.group(2).strip()
            if not stmt or stmt.startswith(".pragma"):
                continue
            self.instrs.append(self.parse(stmt))

    @staticmethod
    def parse(stmt):
        pred = None
        m = re.match(r"^@(!?)(%?\w+)\s+(.*)$", stmt)
        if m:
            pred = (m.group(1) == "!", m.group(2))
            stmt = m.group(3)
        parts = stmt.split(None, 1)
        op = parts[0]
        args = []
        if len(parts) > 1:
            s = parts[1]
            depth = 0
            cur = ""
            for ch in s:
                if ch in "{[":
                    depth += 1
                elif ch in "}]":
                    depth -= 1
                if ch == "," and depth == 0:
                    args.append(cur.strip())
                    cur = ""
                else:
                    cur += ch
            if cur.strip():
                args.append(cur.strip())
        return (pred, op, args)




class InlineAsmProgram(Program):
    """The base parser, after two rewrites of the DSL's inline-asm blocks: braces dropped and
    their local labels (LAB_WAIT, DONE: one pair per block) made unique per block."""

    def __init__(self, ptx: str):
        head, body = ptx.split(".entry", 1)
        out, blk = [], 0
        opened = False
        for raw in body.split("\n"):
            line = raw.split("//")[0].strip()
            if line == "{":
                if opened:
                    blk += 1
                    continue
                opened = True  # the function body's own brace
            elif line == "}":
                continue
            elif blk:
                line = re.sub(r"\b(LAB_WAIT|DONE)\b", lambda m, b=blk: f"{m.group(1)}_{b}", line)
            out.append(line)
        super().__init__(head + ".entry" + "\n".join(out) + "\n}")


def named_barriers(prog: Program) -> Program:
    """Every bar.sync becomes the private opcode NBAR (HopperCTA yields it with its id and thread
    count): the base interpreter knows only CTA-wide barriers. Rewrites `prog` in place; returns it."""
    out = []
    for pred, op, args in prog.instrs:
        if op in ("bar.sync", "barrier.sync", "barrier.sync.aligned"):
            op = NBAR
        out.append((pred, op, args))
    prog.instrs = out
    return prog
