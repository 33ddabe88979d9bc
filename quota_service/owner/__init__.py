"""Instances served from memory: each instance's state machine, owned by one replica and
journaled to PostgreSQL in group commits."""
