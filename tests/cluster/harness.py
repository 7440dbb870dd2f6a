"""The cluster harness lives in the package (``sluice.harness.embedded_cluster``) so ``sluice bench e2e --cluster`` can
start one too; the tests import it from here."""

from sluice.harness.embedded_cluster import (
    SLOTS,
    Cluster,
    ClusterError,
    NodeInfo,
    SlotMigration,
    find_binary,
    key_slot,
    start_cluster,
)

__all__ = ["SLOTS", "Cluster", "ClusterError", "NodeInfo", "SlotMigration", "find_binary", "key_slot", "start_cluster"]
