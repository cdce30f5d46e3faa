"""OpenAI's Files API: batch input and output files of a tenant, kept in a file
store behind a small interface (:class:`~conveyor.files.store.FileStore`)."""
