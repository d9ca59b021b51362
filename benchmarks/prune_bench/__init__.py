"""The modules of ``benchmarks/bench_prune.py`` (whole patched models against the unpruned model
and ToMe): ``models`` (the model cases and method grids), ``matrix`` (the interleaved timing
sweep), ``overhead`` (what the reduction adds to a forward), ``report`` (tables, checks, page)."""
