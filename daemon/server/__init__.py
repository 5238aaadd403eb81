"""The daemon itself, composing every other layer.

The Unix-socket server and its connections (framing), the request handlers, promotions,
recovery, gc, the attempt directories, the reload on SIGHUP, systemd integration and the
process lifecycle.

Floor 6: the top; nothing in ``daemon``'s subpackages imports it.
"""
