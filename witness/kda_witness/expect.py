"""`expect`: fail unless the named kernels launched, and say why each fallback happened.

A kernel counts as launched when its name is a substring of some traced kernel's name (the CuTe
DSL decorates kernel names). The failure message lists the missing kernels with their stage,
then every stage that fell back with the reason the chain recorded, then the expected stages that
never ran at all, so the message alone answers "why did my kernel not run?".
"""

from __future__ import annotations

from collections.abc import Iterable

from .ranges import expected_kernels
from .results import Results


class WitnessError(AssertionError):
    """Raised by `expect`; an AssertionError so pytest reports it as a plain failure."""


def expect(results: Results, kernels: Iterable[str] | str | None = None) -> Results:
    """Assert every kernel in `kernels` launched in `results`; returns `results` for chaining.

    `kernels` None: the kernels the op registered (`register_kernels`; kda_chain does at import)."""
    CUTE_KERNELS = expected_kernels()
    if kernels is None:
        if not CUTE_KERNELS:
            raise WitnessError("kda_witness: no kernels given and none registered (import kda_chain, "
                               "or pass kernels=[...])")
        kernels = tuple(CUTE_KERNELS)
    if isinstance(kernels, str):
        kernels = (kernels,)
    missing = [k for k in kernels if not results.launched(k)]
    if not missing:
        return results
    lines = ["kda_witness: kernels not launched: "
             + ", ".join(f"{k} (stage {CUTE_KERNELS[k]})" if k in CUTE_KERNELS else k for k in missing)]
    if not results.has_kernels:
        lines.append("  no CUDA kernels were recorded at all (no CUDA device, or the profiler saw no "
                     "CUDA activity)")
    for k in missing:
        stage = CUTE_KERNELS.get(k)
        if stage and any(r.impl == "cute" for r in results.stage(stage)):
            lines.append(f"  stage {stage} ran impl cute but no kernel named like {k} was traced")
    fallbacks = results.fallbacks()
    if fallbacks:
        lines.append("stages that fell back (stage -> impl taken: recorded reason):")
        lines += [f"  {r.stage} -> {r.impl}: {r.reason} ({r.calls} call{'s' * (r.calls != 1)})"
                  for r in fallbacks]
    never = [CUTE_KERNELS[k] for k in missing if k in CUTE_KERNELS and not results.stage(CUTE_KERNELS[k])]
    if never:
        lines.append("stages with no kda:: range in the trace (never called): " + ", ".join(never))
    if not results.stages:
        lines.append("the trace holds no kda:: ranges at all: did the code run through kda_chain?")
    raise WitnessError("\n".join(lines))
