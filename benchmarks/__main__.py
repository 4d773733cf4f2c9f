"""``python -m benchmarks``: the suite runner (see :mod:`benchmarks.run`)."""

from benchmarks.run import main

raise SystemExit(main())
