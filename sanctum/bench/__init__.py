"""`sanctum bench`: interleaved A/B benchmarks (DESIGN.md rule 6).

    schedule   which arm runs when: interleaved rounds, randomised start, warm-up
    stats      medians, spreads, per-pair ratios, the interleaving check
    runner     runs a schedule against arms, recording load average per slot
    workloads  prompts taken from held-out demo-corpus files
    arms       the things being compared (our stack, in-process mlx-lm, ...)
    servers    processes a benchmark starts and proves stopped
    null_seat  a seat that answers instantly, speaking the real protocol
    rules      the sampling rules (keyed, rejection, plain) on one speculating seat
    flips      where speculative answers leave plain ones (float near-ties), and why
    report     docs/BENCHMARKS.md and its plots, from stored results
"""
