"""The operator's surface.

The operator's surface: Prometheus metrics and their exporter, ``health``, the plan
of a configuration reload, and the ``ckptd`` commands that inspect roots or ask the
daemon.

Floor 5, beside ``nodes`` and ``retention``: imports the floors below, never a peer.
"""
