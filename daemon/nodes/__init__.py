"""Saves that span nodes.

Saves that span nodes: the attempt agreed from markers, this node's marker written,
the shared directory watched (:mod:`._coordinator`, :mod:`._waker`), and the markers a
``ckptd promote`` of such a step is judged by (:mod:`._rescue`).

Floor 5, beside ``retention`` and ``ops``: imports the floors below, never a peer.
"""
