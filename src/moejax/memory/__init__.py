"""Memory savings: recompute policies (and, later, host-side EMA and the budget model)."""
