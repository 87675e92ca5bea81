"""The ``teamdesk-tasks`` command line and the local cluster runner; nothing imports it."""
