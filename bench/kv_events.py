"""Does the KV-event subscriber keep up? A simulated host in another process publishes vLLM-format
event batches at a target rate, driven by a simulated block pool (stores, and evictions once it
is full); this process subscribes, decodes every batch, and measures the rate it receives and the
lag (receive time minus the batch's timestamp), per second, so a growing lag shows.

    python -m bench.kv_events --rate 10000 --seconds 10 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import statistics
import sys
import time

from quota_service.engine.simulated import EventPublisher, SimulatedPool
from quota_service.engine.vllm.subscriber import Received, Subscriber

EVENTS_PER_BATCH = 50  # vLLM publishes one batch per engine step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def publish(endpoints: tuple[str, str], rate: float, seconds: float) -> None:
    publisher = EventPublisher(*endpoints)
    await asyncio.sleep(1.0)  # let the subscriber connect
    pool = SimulatedPool(num_blocks=20_000, block_size=16)
    rng = random.Random(1)
    live: list[str] = []
    pending: list[dict[str, object]] = []
    started = time.monotonic()
    sent = 0
    n = 0
    while time.monotonic() - started < seconds:
        while len(pending) < EVENTS_PER_BATCH:
            n += 1
            prompt = [rng.randrange(32_000) for _ in range(16 * rng.randint(2, 8))]
            events = pool.admit(f"r{n}", prompt, 16, None)
            if events is None or len(live) > 500:
                pool.finish(live.pop(0))
                continue
            live.append(f"r{n}")
            pending.extend(events)
        await publisher.publish(pending[:EVENTS_PER_BATCH])
        del pending[:EVENTS_PER_BATCH]
        sent += EVENTS_PER_BATCH
        ahead = sent / rate - (time.monotonic() - started)
        if ahead > 0:
            await asyncio.sleep(ahead)
    await asyncio.sleep(0.5)
    publisher.close()


def run_publisher(endpoints: tuple[str, str], rate: float, seconds: float) -> None:
    asyncio.run(publish(endpoints, rate, seconds))


async def subscribe(endpoints: tuple[str, str], seconds: float) -> list[tuple[float, int, float]]:
    """(receive time, events, lag seconds) per batch."""
    subscriber = Subscriber(*endpoints)
    subscriber.connect()
    samples: list[tuple[float, int, float]] = []

    async def read() -> None:
        async for item in subscriber.items():
            assert isinstance(item, Received), item
            now = time.time()
            samples.append((now, len(item.batch.events), now - item.batch.ts))

    task = asyncio.create_task(read())
    await asyncio.sleep(seconds + 2.5)
    task.cancel()
    subscriber.close()
    return samples


def report(samples: list[tuple[float, int, float]], rate: float) -> dict[str, object]:
    start = samples[0][0]
    per_second: dict[int, list[tuple[int, float]]] = {}
    for at, events, lag in samples:
        per_second.setdefault(int(at - start), []).append((events, lag))
    windows = [per_second[k] for k in sorted(per_second)][:-1] or [per_second[0]]
    lags = [lag for _, _, lag in samples]

    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    return {
        "target_events_per_second": rate,
        "received_events_per_second": round(
            sum(events for window in windows for events, _ in window) / len(windows)
        ),
        "batches": len(samples),
        "lag_p50_ms": round(p(lags, 50) * 1000, 2),
        "lag_p99_ms": round(p(lags, 99) * 1000, 2),
        "lag_max_ms": round(max(lags) * 1000, 2),
        "first_second_lag_p99_ms": round(p([lag for _, lag in windows[0]], 99) * 1000, 2),
        "last_second_lag_p99_ms": round(p([lag for _, lag in windows[-1]], 99) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, nargs="+", default=[10_000, 20_000])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for rate in args.rate:
        endpoints = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        print(f"{rate:g} events/s for {args.seconds:g} s", file=sys.stderr)
        host = multiprocessing.Process(target=run_publisher, args=(endpoints, rate, args.seconds))
        host.start()
        samples = asyncio.run(subscribe(endpoints, args.seconds))
        host.join()
        results.append(report(samples, rate))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    columns = list(results[0])
    print("  ".join(f"{c:>24}" for c in columns))
    for row in results:
        print("  ".join(f"{row[c]!s:>24}" for c in columns))


if __name__ == "__main__":
    main()
