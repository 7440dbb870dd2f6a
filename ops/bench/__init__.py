"""``sluice bench``: sluice measured side by side with a floor and the official SDKs in the same run."""
