"""Provider capacity: a limited route's admission, permits, fallbacks and gauges, held in Redis for every
worker of a key prefix together.

Rule: the pipeline uses ``admission`` (offer, admit, acquire, renew, release), ``permits`` (one permit per
attempt, the lease), ``spend`` (an attempt's budget reservation; ``budgets`` says which budgets and how
much), ``fallback`` (pure: which failure hops where) and ``gauges`` (the route metrics);
``scripts`` (the capacity store's Lua) and ``state`` (reads of a store for the CLI and the gauges) are this
package's own. Nothing here imports the pipeline.
"""
