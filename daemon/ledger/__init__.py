"""The pure rules of the ledger.

The pure rules: every in-flight save as a state machine (:mod:`._ledger`, with its
mixins :mod:`._deadlines`, :mod:`._outcomes` and :mod:`._spanning`), the records the
journal stores (:mod:`._records`) and replaying them (:mod:`._replay`).

No I/O and no clock: time and events come in as arguments, effects go out as values.
Floor 2: imports only ``daemon.base`` and ``daemon.config``.
"""
