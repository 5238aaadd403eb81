"""All blocking work on checkpoint roots, behind one storage interface.

The interface is :class:`._storage.Storage`; :class:`._local.LocalStorage` implements it
on POSIX. Behind it: verification,
promotion, attempt directories, node markers, fences, gc, the trash, retention's
reads and renames, the journal file and the per-root lanes its calls run in.

Floor 3: imports ``daemon.base``, ``daemon.config`` and ``daemon.ledger``.
"""
