"""The append path, one home: a batch of raw rows and contract events (``batch``), one attempt's ordered
appends (``store``), the request's scripts (``log``), the worker's shared append connection (``mux``) and
the hand-packed RESP connection under it (``pipe``)."""
