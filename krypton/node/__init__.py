"""Krypton as an AI node beside a PACS: a DICOM Storage SCP (:mod:`krypton.node.scp`) that
explains each series routed to it once it is stable and stores the result back in its
study, and the spool that holds what it received (:mod:`krypton.node.spool`)."""

from .scp import Node, NodeSettings
from .spool import SeriesState, Spool

__all__ = ["Node", "NodeSettings", "SeriesState", "Spool"]
