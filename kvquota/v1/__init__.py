"""Generated from proto/kvquota; run `make proto` to regenerate."""
