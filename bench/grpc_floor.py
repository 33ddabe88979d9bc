"""The floor any Python gRPC service pays: a bare grpc.aio server that answers Admit with a
reservation of 96 block handles and Release with the reservation's name, doing nothing else (no
ledger, no authentication, no interceptors). The benchmarks load it with the same load generator
as kvquota, beside it in the same run, so that kvquota's figures read against what the transport
alone costs on the same machine at the same moment.

    python -m bench.grpc_floor    (serves; prints "serving gRPC on host:port" like kvquota)
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc

from kvquota.v1 import admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service import event_loop
from quota_service.config import load_settings

BLOCKS = 96


async def admit(
    request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> admission_pb2.AdmitResponse:
    name = f"{request.tenant}/reservations/{request.request_id}"
    reservation = pb.Reservation(
        name=name,
        state=pb.RESERVATION_STATE_ADMITTED,
        reserved_blocks=BLOCKS,
        block_table=[pb.BlockHandle(block_id=i, generation=1) for i in range(BLOCKS)],
    )
    return admission_pb2.AdmitResponse(reservation=reservation)


async def release(
    request: admission_pb2.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> pb.Reservation:
    return pb.Reservation(name=request.name, state=pb.RESERVATION_STATE_ENDED)


def handlers() -> grpc.GenericRpcHandler:
    """AdmissionService's Admit and Release, and nothing else."""
    return grpc.method_handlers_generic_handler(
        "kvquota.v1.AdmissionService",
        {
            "Admit": grpc.unary_unary_rpc_method_handler(
                admit,
                request_deserializer=admission_pb2.AdmitRequest.FromString,
                response_serializer=admission_pb2.AdmitResponse.SerializeToString,
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                release,
                request_deserializer=admission_pb2.ReleaseRequest.FromString,
                response_serializer=pb.Reservation.SerializeToString,
            ),
        },
    )


async def serve() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"floor serving gRPC on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    # On the event loop the servers measured beside it run on (KVQUOTA_EVENT_LOOP).
    event_loop.run(serve(), load_settings().event_loop)
