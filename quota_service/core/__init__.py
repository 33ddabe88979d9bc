"""Pure decisions over plain values: no I/O, no imports from the other layers."""
