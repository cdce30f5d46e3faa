"""OpenAI's Files API: batch input and output files of a tenant, kept in the file
store (:class:`~conveyor.files.local.LocalFileStore`)."""
