"""The local test mesh: daemons as separate processes, their fault schedule, one report."""
