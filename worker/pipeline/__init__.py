"""The job pipeline: a job from the jobs stream to its terminal.

Rule: ``consumer`` is the process's loop (read, heartbeat, reclaim, cancels) and hands each entry to
``intake`` (decode, dead-letter, offer a limited route's job); ``claim`` claims or takes over a request;
``attempts`` runs its attempts, each one ``upstream`` call; ``finalize`` publishes the terminal once and
acks. ``context`` is what a process's jobs share, ``membership`` which routes a group serves. The pipeline
reaches capacity through ``sluice.worker.capacity``'s interface and reports through
``sluice.worker.observability``; neither imports it back.
"""
