"""Performance and paper-reproduction scripts (never imported by tests)."""
