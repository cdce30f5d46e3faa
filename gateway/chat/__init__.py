"""Chat completions and completions: their routes (``api_router``), beside the
Responses, Files and jobs APIs' packages. The machinery every API shares
(submitting to the pipeline, replies, resumption, SSE) is in ``gateway/``."""
