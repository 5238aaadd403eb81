"""Saves that span nodes.

The attempt agreed from markers (:mod:`._joining`), this node's marker written, the
shared directory watched (:mod:`._coordinator`, :mod:`._waker`), and the markers a
``ckptd promote`` of such a step is judged by (:mod:`._rescue`).

Floor 5, beside ``retention`` and ``ops``: imports the floors below, never a peer.
"""
