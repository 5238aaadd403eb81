"""Fault injection: daemon kills, rank faults, disk faults, protocol fuzzing.

The pytest modules here run a short sample of each campaign; ``python -m tests.faults``
(or ``scripts/faults``) runs the long one and writes the figures of docs/reliability.md.
"""
