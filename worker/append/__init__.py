"""The append side, three files: a batch of raw rows and contract events (``batch``), one attempt's ordered
appends (``store``) and the request's scripts (``log``), sent on the Redis layer's routed connections
(``sluice.worker.redis.route``)."""
