"""Where the process's keyed lookup was: it is :class:`topics.lookup.SharedLookup`
now. Kept only for the gateway's imports while its wiring moves; import from
topics/lookup.py."""

from topics.lookup import LookupClosed, Reader, SharedLookup

__all__ = ["SharedLookup", "Reader", "LookupClosed"]
