"""nbkv's benchmarks: one script per operation (``bench_*.py``), a suite runner, plots.

``python -m benchmarks`` runs every ``bench_*.py`` here in its own process, writes each
one's JSON and printed output to ``benchmarks/results/<name>-<machine tag>.{json,txt}``
with a suite index (``index.json``), and draws the figures (``<name>-<tag>.png``) from the
JSON files; ``python -m benchmarks --help`` lists the options (``--quick``, ``--only``,
``--out``, ``--plots-only``). :mod:`benchmarks.plots` holds the plotting functions, which
take a loaded JSON file, for use in a notebook.
"""
