"""Migrations are the only way the schema changes: they must build exactly what the models say."""

from __future__ import annotations

import json

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, pool, text

from quota_service.store import migrate
from quota_service.store.database import sqlalchemy_url
from quota_service.store.schema import Base


def test_migrations_match_the_models(database_url: str) -> None:
    assert not migrate.pending(database_url)
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_instances_registered_before_0018_are_found_by_engine_address(database_url: str) -> None:
    migrate.downgrade(database_url, "0017")
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO instances (instance, block_size, capacity_blocks, free_blocks, "
                "max_model_len, engine_url) VALUES ('gpu-0', 16, 1, 1, 64, 'http://10.0.0.5:8000/')"
            )
        )
    migrate.upgrade(database_url)
    with engine.connect() as conn:
        address = conn.execute(text("SELECT engine_address FROM instances")).scalar_one()
    engine.dispose()
    assert address == "10.0.0.5:8000"


# What each journaled write of a reservation or a pool delta pays for (an index entry, a foreign
# key's check), before 0028 and after.
CHECKED_0027 = {
    "pk_reservations",
    "uq_reservations_holder_id",
    "ix_reservations_queue",
    "ix_reservations_abort_pending",
    "ix_reservations_wait_deadline",
    "ix_reservations_live_lease",
    "ix_reservations_live_instance",
    "ix_reservations_live_tenant",
    "fk_reservations_tenant_tenants",
    "fk_reservations_instance_instances",
    "pk_pool_deltas",
    "fk_pool_deltas_instance_instances",
}
CHECKED_0028 = {"pk_reservations", "ix_reservations_live", "pk_pool_deltas"}


def test_journaled_rows_keep_their_keys_and_one_index_of_the_live_reservations(
    database_url: str,
) -> None:
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)

    def checked() -> set[str]:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT indexname FROM pg_indexes "
                    "WHERE tablename IN ('reservations', 'pool_deltas') "
                    "UNION SELECT conname FROM pg_constraint WHERE contype = 'f' "
                    "AND conrelid IN ('reservations'::regclass, 'pool_deltas'::regclass)"
                )
            )
            return set(found.scalars())

    assert checked() == CHECKED_0028
    migrate.downgrade(database_url, "0027")
    assert checked() == CHECKED_0027
    migrate.upgrade(database_url)
    assert checked() == CHECKED_0028
    engine.dispose()


# Owners' rows as 0028 keeps them: the instance's own clocks and each tenant's.
OWNER_CLOCKS_0028 = {
    "virtual_time": {"0": 12.5},
    "mean_hold_seconds": 0.25,
    "drift_blocks": 3,
    # With totals on the instance, and without (the upgrade makes it a row holding nothing).
    "tenants/acme": {"last_finish": {"0": 12.5, "2": 4.0}, "mean_hold_seconds": 0.5},
    "tenants/beta": {"last_finish": {"0": 7.0}, "mean_hold_seconds": None},
}


def test_tenants_clocks_move_beside_their_totals_keyed_by_instance_and_back(
    database_url: str,
) -> None:
    migrate.downgrade(database_url, "0028")
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)

    def key() -> str:
        with engine.connect() as conn:
            found: str = conn.execute(
                text(
                    "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE conname = 'pk_instance_tenant_totals'"
                )
            ).scalar_one()
            return found

    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO instances (instance, block_size, capacity_blocks, free_blocks, "
                "max_model_len) VALUES ('gpu-0', 16, 8, 8, 64)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO instance_owners (instance, owner, epoch, clocks) "
                "VALUES ('gpu-0', 'replica-a', 1, CAST(:clocks AS jsonb))"
            ),
            {"clocks": json.dumps(OWNER_CLOCKS_0028)},
        )
        conn.execute(
            text(
                "INSERT INTO instance_tenant_totals (tenant, instance, blocks_in_use, "
                "tokens_in_flight) VALUES ('acme', 'gpu-0', 4, 64)"
            )
        )
    assert key() == "PRIMARY KEY (tenant, instance)"
    migrate.upgrade(database_url)
    assert key() == "PRIMARY KEY (instance, tenant)"
    with engine.connect() as conn:
        owner = conn.execute(text("SELECT clocks FROM instance_owners")).scalar_one()
        tenants = conn.execute(
            text(
                "SELECT tenant, blocks_in_use, tokens_in_flight, last_finish, mean_hold_seconds "
                "FROM instance_tenant_totals ORDER BY tenant"
            )
        ).all()
    assert owner == {"virtual_time": {"0": 12.5}, "mean_hold_seconds": 0.25, "drift_blocks": 3}
    assert tenants == [
        ("acme", 4, 64, {"0": 12.5, "2": 4.0}, 0.5),
        ("beta", 0, 0, {"0": 7.0}, None),
    ]
    migrate.downgrade(database_url, "0028")
    with engine.connect() as conn:
        owner = conn.execute(text("SELECT clocks FROM instance_owners")).scalar_one()
    assert owner == OWNER_CLOCKS_0028
    assert key() == "PRIMARY KEY (tenant, instance)"
    migrate.upgrade(database_url)
    engine.dispose()


# An owned instance's counters before 0030, as its last batch wrote them into `instances`, and
# its owner's clocks (the mean holding time and drift the counters also kept).
COUNTERS_0029 = {
    "free_blocks": 3,
    "cached_blocks": 2,
    "blocks_in_use": 2,
    "pinned_blocks": 1,
    "queued_requests": 2,
    "queued_prompt_tokens": 96,
}
CLOCKS_0029 = {"virtual_time": {"0": 1.5}, "mean_hold_seconds": 0.25, "drift_blocks": 1}
_COUNTERS = (
    "SELECT instance, free_blocks, cached_blocks, blocks_in_use, pinned_blocks, queued_requests, "
    "queued_prompt_tokens, mean_hold_seconds, drift_blocks FROM {} ORDER BY instance"
)


def test_0030_moves_the_pools_counters_into_their_owners_rows(database_url: str) -> None:
    migrate.downgrade(database_url, "0029")
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    columns = ", ".join(COUNTERS_0029)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO instances (instance, block_size, capacity_blocks, max_model_len, "
                f"mean_hold_seconds, drift_blocks, {columns}) VALUES ('gpu-0', 16, 8, 64, 0.25, 1, "
                + ", ".join(str(n) for n in COUNTERS_0029.values())
                + "), ('gpu-1', 16, 4, 64, NULL, 0, 4, 0, 0, 0, 0, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO instance_owners (instance, owner, epoch, batch, clocks) "
                "VALUES ('gpu-0', 'replica-a', 1, 7, CAST(:clocks AS jsonb))"
            ),
            {"clocks": json.dumps(CLOCKS_0029)},
        )
        before = conn.execute(text(_COUNTERS.format("instances"))).all()
    migrate.upgrade(database_url)
    with engine.connect() as conn:
        # As recorded, and all free on the instance no owner wrote a batch of.
        assert conn.execute(text(_COUNTERS.format("instance_pool_counters"))).all() == before
        owner = conn.execute(
            text(f"SELECT {columns} FROM instance_owners WHERE instance = 'gpu-0'")
        ).one()
        assert owner._asdict() == COUNTERS_0029
        # The fence writes them with the batch.
        number = conn.execute(
            text("SELECT journal_next_batch('gpu-0', 1, CAST('{}' AS jsonb), 4, 2, 1, 1, 1, 48)")
        ).scalar_one()
        assert number == 8
        moved = conn.execute(
            text(f"SELECT {columns} FROM instance_pool_counters WHERE instance = 'gpu-0'")
        ).one()
        assert tuple(moved) == (4, 2, 1, 1, 1, 48)
        conn.rollback()
    migrate.downgrade(database_url, "0029")
    with engine.connect() as conn:
        assert conn.execute(text(_COUNTERS.format("instances"))).all() == before
    migrate.upgrade(database_url)
    engine.dispose()
