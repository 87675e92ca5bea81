"""The Celery tasks of the cluster (export, reminder), their execution wrapper and the app.

``celery -A tasks worker|beat|flower`` finds the app in :mod:`tasks.celery` (Celery looks
for ``tasks.celery`` when the package has no ``app`` attribute), so importing any
``tasks.*`` module never builds an app as a side effect.
"""
