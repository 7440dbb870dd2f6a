"""The project's Redis layer, used by the worker, the client, the relay and the tools alike: ``connect``
(a client from a URL, single instance or Cluster; the URL masked; the layout check), ``cluster`` (redis-py's
cluster client made safe), ``retry`` (which failures are retried, and the errors the layer raises),
``scripts`` (the Lua scripts), ``pipe`` (one hand-packed RESP connection) and ``route`` (the worker's own
connections to each slot's master: the one transport of appends, claims and finalizes)."""
