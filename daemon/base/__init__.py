"""What every layer shares.

What every layer shares: the exception hierarchy (:mod:`._errors`), structured
events (:mod:`._events`) and the crash points of fault-injection tests (:mod:`._faults`).

Floor 0: imports nothing of ``daemon``.
"""
