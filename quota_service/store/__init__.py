"""The ledger in PostgreSQL: schema, units of work, and the only place that writes SQL."""
