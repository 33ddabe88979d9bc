"""`make stress`: the ledger's invariants under random load and injected faults (see run.py)."""
