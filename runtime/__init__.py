"""What the daemon is made of besides the algorithms: config, timeline, report, local mesh."""
