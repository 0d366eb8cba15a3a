"""Why a generation ended: the one finish-reason vocabulary of every tier and both protos."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """String values are what logs and the `finished_reason` metric label carry."""

    STOP = "stop"  # an EOS or stop token id was emitted (it is part of the output)
    LENGTH = "length"  # max_tokens reached
    STOP_STRING = "stop_string"  # the router matched a stop string (public API only)
    ABORT = "abort"  # cancelled or released before the end (never sent as a finish)
    ERROR = "error"  # the step computing it failed: the call ends INTERNAL (never a finish)

    def to_decode_proto(self) -> int:
        """decode_pb2.FinishReason of this reason (ABORT has none: it ends the call)."""
        from megaserve.rpc import decode_pb2

        return {
            FinishReason.STOP: decode_pb2.FINISH_REASON_STOP,
            FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH,
        }[self]

    def to_public_proto(self) -> int:
        """generation_pb2.FinishReason of this reason."""
        from megaserve.v1 import generation_pb2 as pb

        return {
            FinishReason.STOP: pb.FINISH_REASON_STOP,
            FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
            FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
        }[self]

    @classmethod
    def from_decode_proto(cls, value: int) -> FinishReason | None:
        """None for FINISH_REASON_UNSPECIFIED (the stream goes on)."""
        from megaserve.rpc import decode_pb2

        return {
            decode_pb2.FINISH_REASON_STOP: cls.STOP,
            decode_pb2.FINISH_REASON_LENGTH: cls.LENGTH,
        }.get(value)
