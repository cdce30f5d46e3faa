"""Usage accounting: the ledger of what each tenant, key and model used.

Postprocess writes one UsageRecord per finished request to
``conveyor.usage``; the accounting app (:mod:`workers.usage.app`, a Faust
application run by :func:`run_accounting`) counts each request once into
tables by minute and by day and mirrors them into Redis; the
:class:`UsageLedger` reads Redis for the CLI, the admin API and reports.
Redis key layout: :mod:`workers.usage.mirror`.
"""

from workers.usage.ledger import UsageLedger, UsageRow

__all__ = ["UsageLedger", "UsageRow"]
