"""Record the PTX of every CuTe kernel a test run compiles, to prove a refactor changed none.

    pytest -p ptxsim.snapshot --ptx-snapshot DIR tests/kda_cute      # before and after a change
    python -m ptxsim.snapshot BEFORE AFTER                             # compare the two

`cute.compile` is wrapped for the run with `--keep-ptx` added; every result's PTX is written as
`DIR/<sha256>.ptx` and `DIR/index.json` maps each test to the hashes it compiled, in order.
The comparison reports PTX that is byte-identical, identical once the `.entry` symbol (which
the DSL builds from the kernel's module and qualified name) is normalized, and different.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

_ENTRY = re.compile(r"kernel_cutlass_\w+")


def normalized(ptx: str) -> str:
    """The PTX with the mangled kernel symbol replaced (module moves rename it, nothing else)."""
    return _ENTRY.sub("KERNEL", ptx)


def pytest_addoption(parser):
    parser.addoption("--ptx-snapshot", default=None, help="directory to write every compiled PTX to")


def pytest_configure(config):
    out = config.getoption("--ptx-snapshot")
    if not out:
        return
    import cutlass.cute as cute

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, list[str]] = {}
    current = {"test": "<collection>"}
    orig = cute.compile

    class _Compile:
        def __getitem__(self, opts):  # cute.compile[...] forms keep working
            return orig[opts]

        def __call__(self, *args, **kwargs):
            opts = kwargs.get("options") or ""
            if "--keep-ptx" not in opts:
                kwargs["options"] = (opts + " --keep-ptx").strip()
            res = orig(*args, **kwargs)
            text = getattr(res, "__ptx__", None)
            if text:
                text = text if isinstance(text, str) else text.decode()
                h = hashlib.sha256(text.encode()).hexdigest()[:16]
                (root / f"{h}.ptx").write_text(text)
                index.setdefault(current["test"], []).append(h)
            return res

    cute.compile = _Compile()

    class _Hooks:
        def pytest_runtest_setup(self, item):
            current["test"] = item.nodeid

        def pytest_sessionfinish(self, session):
            (root / "index.json").write_text(json.dumps(index, indent=1))

    config.pluginmanager.register(_Hooks(), "ptxsim-snapshot-hooks")


def compare(a: Path, b: Path) -> int:
    """Print the comparison of two snapshot directories; 0 when every PTX matches byte for byte."""
    pa = {p.stem: p.read_text() for p in a.glob("*.ptx")}
    pb = {p.stem: p.read_text() for p in b.glob("*.ptx")}
    same = pa.keys() & pb.keys()
    na = {normalized(t) for k, t in pa.items() if k not in same}
    nb = {normalized(t) for k, t in pb.items() if k not in same}
    renamed = na & nb
    print(f"{a}: {len(pa)} PTX, {b}: {len(pb)} PTX")
    print(f"  byte-identical:                  {len(same)}")
    print(f"  identical but the entry symbol:  {len(renamed)}")
    print(f"  only in {a.name}: {len(na - renamed)}; only in {b.name}: {len(nb - renamed)}")
    return 0 if len(same) == len(pa) == len(pb) else (1 if not (na ^ nb) else 2)


if __name__ == "__main__":
    sys.exit(compare(Path(sys.argv[1]), Path(sys.argv[2])))
