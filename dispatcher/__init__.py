"""Dispatcher: the periodic scan (recover, reconcile, dispatch) and worker heartbeats."""
