"""What the daemon's parts need of the daemon.

What the daemon's parts need of the daemon: small Protocols (:mod:`._host`), so
that no part imports the server, and the count of work whose report waits
(:mod:`._holds`).

Floor 4: imports the floors below.
"""
