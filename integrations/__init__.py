"""Adapters that make serving engines allocate through hbmd; each stays inert until the operator opts in."""
