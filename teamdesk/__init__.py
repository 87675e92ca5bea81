"""TeamDesk task cluster: process-wide pieces (configuration, logging, database, CLI)."""
