"""A simulated vLLM host as its own process, on fixed ports, so that a stress run can kill it with
SIGKILL and start it again where kvquota expects it (an engine restart: an empty pool, events
from sequence 0)."""

from __future__ import annotations

import argparse
import asyncio
import signal

from quota_service.engine.simulated import EventPublisher, SimulatedHost, SimulatedPool


async def serve(args: argparse.Namespace) -> None:
    # Block 0 is vLLM's null block: the ledger's instance has one block fewer.
    pool = SimulatedPool(num_blocks=args.blocks + 1, block_size=args.block_size)
    publisher = EventPublisher(
        f"tcp://127.0.0.1:{args.events_port}", f"tcp://127.0.0.1:{args.replay_port}"
    )
    host = SimulatedHost(pool, publisher, tokens_per_second=args.tokens_per_second)
    await host.serve("127.0.0.1", args.port)
    print(f"simulated engine on 127.0.0.1:{args.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await host.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--events-port", type=int, required=True)
    parser.add_argument("--replay-port", type=int, required=True)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens-per-second", type=float, default=400.0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
