"""The planner: pure functions from a captured model and a cluster to a Plan. No process groups."""
