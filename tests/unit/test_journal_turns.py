"""A replica commits one transaction at a time: the batches written while one is in flight wait,
and the first of them leads the next, for all of them. Callers that give up while they wait
(cancelled) leave the others to go on, and never start a second commit beside the one in flight.
The transactions themselves are left out here (`_commit` is replaced): what is tested is who
commits what, and when; tests/integration/test_journal_group_commit.py commits for real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from quota_service.store import database
from quota_service.store.journal import BatchRows, Journal, _Batch, _Queued


class TurnsJournal(Journal):
    """Commits nothing: each transaction waits until the test ends it, and is recorded."""

    def __init__(self) -> None:
        super().__init__(database.connect("postgresql://kvquota@127.0.0.1:1/unused"))
        self.groups: list[list[str]] = []
        self.ends: list[asyncio.Event] = []
        self.in_flight = 0
        self.most_in_flight = 0
        # Cancelled once the transaction that holds its batch is answered, before it resumes.
        self.cancel_when_answered: dict[str, asyncio.Task[int]] = {}

    async def _commit(self, batches: list[_Batch]) -> list[int]:
        self.groups.append([batch.instance for batch in batches])
        end = asyncio.Event()
        self.ends.append(end)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await end.wait()
        finally:
            self.in_flight -= 1
        return list(range(1, len(batches) + 1))

    async def _settle(self, group: list[_Queued]) -> None:
        await super()._settle(group)
        for queued in group:
            task = self.cancel_when_answered.pop(queued.batch.instance, None)
            if task is not None:
                task.cancel()

    async def end(self, transaction: int) -> None:
        """End the transaction numbered so (from 0), which has started, and let its callers
        and the next leader go on."""
        self.ends[transaction].set()
        await settled()


@pytest.fixture
async def journal() -> AsyncIterator[TurnsJournal]:
    journal = TurnsJournal()
    yield journal
    await journal._engine.dispose()


def write(journal: Journal, instance: str) -> asyncio.Task[int]:
    return asyncio.create_task(journal.write(instance, 1, BatchRows()))


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def written(journal: Journal, *instances: str) -> list[asyncio.Task[int]]:
    """Batches of these instances written, in this order, once they wait (or commit)."""
    tasks = [write(journal, instance) for instance in instances]
    await settled()
    return tasks


async def behind_a(journal: Journal, *instances: str) -> list[asyncio.Task[int]]:
    """a's batch, committing alone, then these written while it is in flight."""
    return [*await written(journal, "a"), *await written(journal, *instances)]


async def test_batches_written_during_a_commit_share_the_next(journal: TurnsJournal) -> None:
    first, *waiting = await behind_a(journal, "c", "b")
    await journal.end(0)
    await journal.end(1)
    assert await first == 1
    # Their transaction holds them in the instances' order.
    assert await asyncio.gather(*waiting) == [2, 1]
    assert journal.groups == [["a"], ["b", "c"]]
    assert journal.most_in_flight == 1


async def test_a_caller_cancelled_while_it_waits_leaves_the_others_to_commit(
    journal: TurnsJournal,
) -> None:
    first, gone, kept = await behind_a(journal, "b", "c")
    gone.cancel()
    await journal.end(0)
    await journal.end(1)
    assert await first == 1 and await kept == 1
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert journal.groups == [["a"], ["c"]]


async def test_a_caller_cancelled_as_it_was_answered_starts_no_commit_beside_the_next(
    journal: TurnsJournal,
) -> None:
    first, leading, answered = await behind_a(journal, "b", "c")
    journal.cancel_when_answered["c"] = answered
    await journal.end(0)
    # b leads b and c; d waits for that commit, and leads the next once it ends, while c, answered
    # and cancelled, goes.
    [later] = await written(journal, "d")
    await journal.end(1)
    with pytest.raises(asyncio.CancelledError):
        await answered
    # e is written while d's commit is in flight: it waits for it.
    [last] = await written(journal, "e")
    await journal.end(2)
    await journal.end(3)
    assert [await first, await leading, await later, await last] == [1, 1, 1, 1]
    assert journal.groups == [["a"], ["b", "c"], ["d"], ["e"]]
    assert journal.most_in_flight == 1


async def test_a_leader_cancelled_mid_commit_fails_the_others_and_hands_on(
    journal: TurnsJournal,
) -> None:
    first, leading, led = await behind_a(journal, "b", "c")
    await journal.end(0)
    # b commits b and c; cut short, whether it took is unknown to both.
    [later] = await written(journal, "d")
    leading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leading
    with pytest.raises(Exception, match="cut short"):
        await led
    await journal.end(2)
    assert await first == 1 and await later == 1
    assert journal.groups == [["a"], ["b", "c"], ["d"]]
    assert journal.most_in_flight == 1
