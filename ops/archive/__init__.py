"""``sluice.archive``: every finished request, written to durable storage before Redis retention expires it.

Rule: ``record`` is the format and the names (one home), ``store`` the destinations, ``archiver`` the
terminal-feed consumer that writes then acks, ``reader`` reading it back (audit, verify, analysts), ``proof``
an index row recomputed from its archived status and log, ``cli`` the ``sluice archive`` command.
"""

from sluice.archive.archiver import DEFAULT_GROUP, Archiver, ArchiverStats
from sluice.archive.reader import read_archived
from sluice.archive.record import ArchiveCorrupt, ArchivedRequest
from sluice.archive.store import DestinationError, LocalStore, ObjectStore, open_destination

__all__ = [
    "DEFAULT_GROUP",
    "ArchiveCorrupt",
    "ArchivedRequest",
    "Archiver",
    "ArchiverStats",
    "DestinationError",
    "LocalStore",
    "ObjectStore",
    "open_destination",
    "read_archived",
]
