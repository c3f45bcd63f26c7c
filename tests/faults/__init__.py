"""Seeded fault-injection scenarios, run in subprocesses by tests/test_faults.py.

A scenario is named ``kind:variant`` and takes a seed; every parameter (capacity,
batch size, echo factor, producer count, when the fault strikes) comes from a
``random.Random(seed)``, so one seed replays one scenario exactly::

    python tests/faults close_put:put_many 1234567 [SPEC SEED ...]

(or ``python -m faults ...`` from tests/) prints PASS or FAIL (with the
traceback) per scenario. Each scenario checks what it delivered example by
example (ids whose payload is derived from the id, counted against what the
buffer accepted) and, when it returns, that it left no thread, process or
shared-memory segment behind.

With ``--protocol LOG`` (the tests' mode) the results go to stdout as JSON
lines; LOG is the file stderr goes to, which each scenario reads back (any
traceback or crash message there fails it). A scenario that runs past
``--timeout`` seconds dumps every thread's stack there and ends the process.

One module per kind of fault, in registry.py; what they share is in common.py
and in the suite's support.py; runner.py is the command line above.
"""
