"""The daemon's configuration.

The daemon's configuration: flags, the TOML file and the environment, validated
(:mod:`._config`, :mod:`._types`), and a root's retention policy (:mod:`._retention`).

Floor 1: imports only ``daemon.base``.
"""
