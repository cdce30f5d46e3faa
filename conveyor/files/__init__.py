"""The file store: where uploaded files and batch input and output live
(``store``: the interface and file objects; ``local``: a local directory).
The Files API serves it and the jobs and results layers read and write it."""
