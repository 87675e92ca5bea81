"""Worker process: lifecycle, heartbeat renewal and the health probe."""
