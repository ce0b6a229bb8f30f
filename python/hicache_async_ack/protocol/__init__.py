"""The engine-agnostic protocol: the pipelined MIN-reduce (:mod:`.reduce`), the
stamp every reduce carries (:mod:`.stamp`), auto depth (:mod:`.depth`), the
prefetch votes' book (:mod:`.votes`) and its own errors (:mod:`.errors`). Imports
neither SGLang nor torch, and names no sync."""

from .depth import WAIT_FLOOR_S, AutoDepth, observation
from .errors import BatchMismatch, PeerMismatch, ProtocolError
from .reduce import Consumed, Head, PipelinedReduce, still_queued

from .stamp import (DEPTH_LIMIT, DIGEST_BITS, IN_TREE_LIMIT, OBS_MAX, OFFLOAD_CODE,  # isort: skip
    PROTOCOL_VERSION, READ_ONCE_FLAG, STOCK_LIMIT, STORAGE_FLAG, VOTES_FLAG, VOTES_SETTING_FLAG,
    Collective, Handle, Stamp, describe_mismatch, fold_digest, pack_stamp,
    stamps_differ)  # fmt: skip
from .votes import (
    ADMIT,
    ADMIT_SLOTS,
    HEADER,
    LAYOUT,
    OVERFLOW_LAYOUT,
    POLICIES,
    REACHED_EXPIRED,
    SLOT,
    VOTE_SLOTS,
    VOTES_PROTOCOL,
    Ballot,
    Exchange,
    Reach,
    Verdicts,
    VoteBook,
    covering,
    key_hash,
    pairs,
    seq_digest,
    shared_tokens,
)

__all__ = ["ADMIT", "ADMIT_SLOTS", "DEPTH_LIMIT", "DIGEST_BITS", "HEADER", "IN_TREE_LIMIT",
    "LAYOUT", "OBS_MAX", "OFFLOAD_CODE", "OVERFLOW_LAYOUT", "POLICIES", "PROTOCOL_VERSION",
    "READ_ONCE_FLAG", "REACHED_EXPIRED", "SLOT", "STOCK_LIMIT", "STORAGE_FLAG", "VOTES_FLAG",
    "VOTES_SETTING_FLAG", "VOTES_PROTOCOL", "VOTE_SLOTS", "WAIT_FLOOR_S", "AutoDepth", "Ballot",
    "BatchMismatch", "Collective", "Consumed", "Exchange", "Handle", "Head", "PeerMismatch",
    "PipelinedReduce", "ProtocolError", "Reach", "Stamp", "Verdicts", "VoteBook", "covering",
    "describe_mismatch", "fold_digest", "key_hash", "observation", "pack_stamp", "pairs",
    "seq_digest", "shared_tokens", "stamps_differ", "still_queued"]  # fmt: skip
