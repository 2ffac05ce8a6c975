"""Benchmarks: ``python -m ar_lab.bench NAME`` (decode, roofline, sampler, constrained, speculative,
lookup, serving, paged, quant).

Each benchmark measures the things it compares side by side in one process, repeats
them, and reports medians with the *ratios* as the key figures: this machine (and a
learner's laptop) is shared and noisy, and a ratio measured in one run survives that
far better than an absolute time.

One module per benchmark (``ar_lab.bench.decode``, ``.roofline``, ``.sampler`` and the rest),
each with a measuring function that returns the results as a JSON-ready dict and prints
nothing, a ``format_*`` function that turns them into the printed table, and the options
of its command. ``__main__`` holds the command line.
"""
