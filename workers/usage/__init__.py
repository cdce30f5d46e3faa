"""Usage accounting: the accounting app (:mod:`workers.usage.app`) counts
``conveyor.usage`` into tables and mirrors them into Redis, where
:class:`UsageLedger` reads them for the CLI, the admin API and reports."""

from workers.usage.ledger import UsageLedger, UsageRow

__all__ = ["UsageLedger", "UsageRow"]
