"""Usage accounting: the accounting app (:mod:`workers.usage.app`) counts
``conveyor.usage`` into tables and mirrors them into Redis, where
:class:`UsageLedger` reads them for the CLI, the admin API and reports, and
indexes each request, which :class:`RequestIndex` searches for the console."""

from workers.usage.ledger import ModelMinute, UsageLedger, UsageRow
from workers.usage.requests import RequestIndex, RequestPage, RequestRow

__all__ = ["UsageLedger", "UsageRow", "ModelMinute", "RequestIndex", "RequestPage", "RequestRow"]
