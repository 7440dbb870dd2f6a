"""Test and demo tooling: servers the suite, ``sluice demo`` and ``sluice bench`` start on loopback.

``embedded_redis`` runs one private redis-server, ``embedded_cluster`` a Redis Cluster of them, ``fake`` the
local fake provider (every dialect, scripted faults). They ship in the package because ``sluice demo``
and ``sluice bench`` use them; nothing in the worker, the client or the relay imports them.
"""
