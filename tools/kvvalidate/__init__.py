"""kvvalidate: kvcached PR #598's validation matrix as a command a user runs on their own machine.

Before deploying a model or an engine release under kvcached, a user wants what the seed's GPU CI
proves, on their GPUs: a kvcached server gives the same greedy tokens and cached-token counts as a
native server launched with the same flags, starts, serves the seed's phases and stops cleanly on a
signal. ``kvvalidate run --matrix seed-basic`` starts those servers (the real engines, the real
models) and prints the seed's checks by name, with ``summary.json`` (every request's tokens). The
same command runs the matrix named cpu here, on tiny random-weight models of the same architectures,
which is how the served tests use it. The cases are data (``cases.py``); the phases are the seed's
(``phases.py``); the checks are named as the seed names them (``checks.py``).
"""
