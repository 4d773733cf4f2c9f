"""In-place gathers of batch rows with one scratch row (beam search's reorder).

``new[i] = old[indices[i]]`` for every row ``i``, in place: rows may repeat (two beams
continuing one parent) and rows may vanish. A row is overwritten only once nothing still
to be written reads it; what is left after that are cycles, each broken by parking one
row in a single scratch row.
"""

from __future__ import annotations

SCRATCH = -1  # a copy from or to the scratch row


def gather_schedule(indices: list[int]) -> list[tuple[int, int]]:
    """The copies ``(dst, src)`` that turn rows ``old`` into ``old[indices]`` in place.

    ``SCRATCH`` as ``dst`` parks a row; as ``src`` it restores it. Rows already in place
    (``indices[i] == i``) are not copied.

    >>> gather_schedule([1, 0])            # a swap: one cycle, broken by the scratch row
    [(-1, 0), (0, 1), (1, -1)]
    >>> gather_schedule([0, 0, 1, 1])      # beams: row 1 is read by row 2 before its turn
    [(3, 1), (2, 1), (1, 0)]
    """
    n = len(indices)
    pending = {i for i in range(n) if indices[i] != i}
    readers = [0] * n  # pending rows that still read row j
    for i in pending:
        readers[indices[i]] += 1
    ready = sorted(i for i in pending if readers[i] == 0)  # nobody reads them: free to write
    ops: list[tuple[int, int]] = []
    while pending:
        while ready:
            i = ready.pop()
            src = indices[i]
            ops.append((i, src))
            pending.discard(i)
            readers[src] -= 1
            if src in pending and readers[src] == 0:
                ready.append(src)
        if not pending:
            break
        # every pending row is read by another pending row: they form cycles
        start = min(pending)
        ops.append((SCRATCH, start))
        i = start
        while True:
            src = indices[i]
            if src == start:
                ops.append((i, SCRATCH))
                pending.discard(i)
                break
            ops.append((i, src))
            pending.discard(i)
            i = src
        for j in range(n):
            readers[j] = 0
        for j in pending:
            readers[indices[j]] += 1
        ready = sorted(j for j in pending if readers[j] == 0)
    return ops
