"""The front door: the ``teamdesk-tasks`` command line and the local cluster runner.

It sits on top of everything (ledger, dispatcher, workers, API) and nothing imports it.
"""
