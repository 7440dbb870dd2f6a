"""The local fake provider: a real HTTP server on loopback speaking every dialect, with scripted faults.
Test and demo infrastructure; nothing in the worker imports it."""
