"""DRAM bandwidth of this GPU by read / write mix, to judge a memory-bound stage against the
right ceiling (CUDA events, median of many, 2 GiB operands: far over L2).

    python bench/bandwidth.py

Why: b1 writes 3.22 GB and reads 2.15 GB per call at the reference shape (60% writes). At
1.52 ms that is 3.53 TB/s in all but already 2.12 TB/s of writes, more than a 1:1 copy writes
at its 4.0 TB/s (2.0). If writes have a lower ceiling than reads, b1's floor is set by its
writes, not by 5.39 GB / 4.0 TB/s; this measures each mix so the question has a number.

Each row counts the DRAM bytes the kernel must move (reads + writes) over its median time:
    read       a.sum()                          all reads
    write      c.fill_(1)                       all writes
    copy 1:1   c.copy_(a)
    add 2:1    torch.add(a, b, out=c)           two reads per write

No 1:2 row: torch has no plain kernel for it. Broadcasting along the outer dim read the source
twice, 2 GiB apart (a 1:1 copy, 4.26 TB/s); side by side (`c2.view(n, 2).copy_(a[:, None]
.expand(n, 2))`) it runs a strided elementwise kernel at 1.34 TB/s (2026-12-01), a figure of that
kernel, not of the memory. The write-only row bounds write-heavy mixes.

Measured (H200, 2026-12-01, bench/results/logs/bandwidth_2026-12-01m_H200.log): read 4.18 TB/s,
write 3.36, copy 4.25, add 4.36. b1 at the reference shape is 60% writes (3.22 of 5.39 GB): at
1.42 ms under ncu it moves 3.80 TB/s, 89% of a copy's rate, and its L2 moves about what a copy's
does (SM side 6.44 GB + DRAM side 5.39 in 1.42 ms, 8.3 TB/s; a copy 8.5).
"""

import torch
from cuda_clock import median_ms

GIB = 1 << 30


def main():
    n = 2 * GIB // 2  # bf16 elements of one 2 GiB operand
    a = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    c = torch.empty_like(a)
    nb = n * 2
    rows = [
        ("read", lambda: a.sum(dtype=torch.float32), nb, 0),
        ("write", lambda: c.fill_(1), 0, nb),
        ("copy 1:1", lambda: c.copy_(a), nb, nb),
        ("add 2:1", lambda: torch.add(a, b, out=c), 2 * nb, nb),
    ]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| mix | ms | reads GB | writes GB | TB/s | write TB/s |")
    print("|---|---|---|---|---|---|")
    for name, fn, r, w in rows:
        ms = median_ms(fn, warmup=3, reps=30)
        tb = (r + w) / ms / 1e9
        print(f"| {name} | {ms:.3f} | {r / 1e9:.2f} | {w / 1e9:.2f} | {tb:.2f} | {w / ms / 1e9:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
