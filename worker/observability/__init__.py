"""What the worker tells its operator: telemetry (traces and metrics), the GenAI conventions' names, the
admin endpoint (/healthz, /readyz, /metrics), structured logs and the archive-lag warning.

Rule: nothing here imports the job pipeline or capacity; they call in.
"""
