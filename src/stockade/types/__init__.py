"""Frozen value objects shared by every part of stockade.

Each concern has a module of its own (limits, network, the sandbox's rules, enforcement, the
results of calls, files, snapshots); every name is imported from here, ``stockade.types``.
"""

from __future__ import annotations

from stockade.types._enforcement import Enforcement, HostShare, Mechanism, TierReport, Trust
from stockade.types._files import DownloadResult, EntryInfo, EntryType, Listing, SkippedEntry
from stockade.types._limits import FILE_COST_BYTES as FILE_COST_BYTES
from stockade.types._limits import INODES_PER_MIB as INODES_PER_MIB
from stockade.types._limits import MAX_INODES as MAX_INODES
from stockade.types._limits import MAX_PENDING_APPROVALS as MAX_PENDING_APPROVALS
from stockade.types._limits import MIN_FILES_PER_PROCESS as MIN_FILES_PER_PROCESS
from stockade.types._limits import MIN_SCRATCH_INODES as MIN_SCRATCH_INODES
from stockade.types._limits import OLD_DEFAULT_INODES as OLD_DEFAULT_INODES
from stockade.types._limits import Limits
from stockade.types._limits import MiB as MiB
from stockade.types._limits import limits_from_fields as limits_from_fields
from stockade.types._limits import limits_of_old_places as limits_of_old_places
from stockade.types._network import CREDENTIAL_STYLES as CREDENTIAL_STYLES
from stockade.types._network import HEADER_NAME as HEADER_NAME
from stockade.types._network import Credential, EgressRecord, HostRule, NetworkPolicy, SecretSource
from stockade.types._results import CommandResult, Execution, ExecutionError, Logs, Result
from stockade.types._rules import ExecRecord, JudgedExecs, ReadOnly, SandboxRules
from stockade.types._snapshots import Snapshot, SnapshotKind

__all__ = [
    "CommandResult",
    "Credential",
    "DownloadResult",
    "EgressRecord",
    "Enforcement",
    "EntryInfo",
    "EntryType",
    "ExecRecord",
    "Execution",
    "ExecutionError",
    "HostRule",
    "HostShare",
    "JudgedExecs",
    "Limits",
    "Listing",
    "Logs",
    "Mechanism",
    "NetworkPolicy",
    "ReadOnly",
    "Result",
    "SandboxRules",
    "SecretSource",
    "SkippedEntry",
    "Snapshot",
    "SnapshotKind",
    "TierReport",
    "Trust",
]
