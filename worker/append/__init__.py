"""The append side, two files: one attempt's ordered appends (``store``), and the request's scripts with what
one append carries, a batch of raw rows and contract events (``log``), sent on the Redis layer's routed
connections (``sluice.worker.redis.route``)."""
