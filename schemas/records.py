"""Typed mirrors of the Avro schemas in ``avro/``.

The codec reads and writes plain dicts (that is what fastavro produces); these
TypedDicts give them names and types for mypy. A field marked ``NotRequired``
has a default in its schema and may be left out when writing.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

__all__ = ["ChunkHeader", "Embedding", "EmbeddingAsk", "HostCache", "KvCache", "Control",
           "DeadLetter", "Envelope", "ErrorInfo",
           "Generation", "ImageRef", "Message", "Prepared", "Prompt", "Reply", "Request", "Route",
           "Fallback",
           "ResponseFormat", "ToolCall", "TokenLogprob", "TopLogprob", "Function", "Tools",
           "ReplyBatch", "Sampling", "Task", "TokenBatch", "TokenChunk", "Usage", "WorkerHeartbeat",
           "JobCommand", "JobStatus",
           "JobResult", "UsageRecord", "AuditEvent", "Feedback", "ApiKey", "TenantPolicy",
           "BreakerState", "ModelRegistry", "PolicyDocument", "MeaningDecision", "MeaningScore"]


class Envelope(TypedDict):
    request_id: str
    tenant: str
    key_id: str
    job_id: str
    job_item: str
    traceparent: str
    attempt: int
    reply_gateway: str
    reply_partition: int
    deadline_ms: int
    priority: int
    stamps: dict[str, int]


class ToolCall(TypedDict):
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ImageRef(TypedDict):
    """An image part of a message, by reference: its bytes are in the file store."""

    file_id: str  # the file (purpose vision) of the request's tenant
    media_type: str  # image/png, image/jpeg, image/webp or image/gif
    bytes: int
    sha256: str  # of the bytes, hex
    width: int
    height: int
    detail: NotRequired[str]  # auto, low or high
    offset: NotRequired[int]  # the characters of content before the image
    part: NotRequired[str]  # the part as the request named it: messages[1].content[0]


class Message(TypedDict):
    role: str
    content: str
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall] | None]  # an assistant turn's calls
    tool_call_id: NotRequired[str | None]  # a tool turn: the call it answers
    images: NotRequired[list[ImageRef] | None]  # its image parts, in order


class Function(TypedDict):
    name: str
    description: str
    parameters: str  # the JSON Schema as JSON text; "" for none
    strict: bool


class Tools(TypedDict):
    functions: list[Function]
    choice: Literal["none", "auto", "required", "function"]
    function: str  # the function tool_choice names ("function")
    parallel: bool


class Sampling(TypedDict):
    temperature: float
    top_p: float
    max_tokens: int | None
    stop: list[str]
    seed: int | None
    presence_penalty: NotRequired[float]
    frequency_penalty: NotRequired[float]
    logit_bias: NotRequired[dict[str, float]]  # token id (decimal) -> bias, -100..100
    logprobs: NotRequired[bool]
    top_logprobs: NotRequired[int]


class TopLogprob(TypedDict):
    token: str
    bytes: bytes
    logprob: float


class TokenLogprob(TypedDict):
    token: str
    bytes: bytes
    logprob: float
    top: list[TopLogprob]


class ResponseFormat(TypedDict):
    # tool_calls: only inside the infer worker, from the request's tools (schemas/tools.py)
    type: Literal["json_object", "json_schema", "tool_calls"]
    name: str
    schema: str  # the JSON Schema as JSON text; "" for json_object
    strict: bool


class EmbeddingAsk(TypedDict):
    inputs: list[str | list[int]]  # each a text or token ids
    encoding_format: Literal["float", "base64"]
    dimensions: int | None


class Generation(TypedDict):
    kind: Literal["chat", "completion", "embedding"]
    model: str
    messages: list[Message]
    prompt: str | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    created: int
    store: bool
    metadata: dict[str, str]
    api: str
    response_format: NotRequired[ResponseFormat | None]
    tools: NotRequired[Tools | None]
    # the Responses API: the response this one continues, and how many of the
    # messages (after this request's instructions) are its conversation
    previous_response_id: NotRequired[str]
    history_messages: NotRequired[int]
    embedding: NotRequired[EmbeddingAsk | None]  # kind embedding only


class Prompt(TypedDict):
    text: str | None
    tokens: int
    exact: bool
    max_tokens: int
    dropped_messages: int
    fingerprint: str
    prefix_blocks: list[int]
    cache_key: NotRequired[str]  # "" or absent: the answer is not cached
    cache_ttl_s: NotRequired[int]


class Fallback(TypedDict):
    model: str
    pool: str


class MeaningScore(TypedDict):
    route: str
    model: str
    score: float


class MeaningDecision(TypedDict):
    alias: str
    method: str
    floor: float
    route: str
    model: str
    scores: list[MeaningScore]


class Route(TypedDict):
    model: str
    pool: str
    worker_id: str
    partition: int
    fallbacks: NotRequired[list[Fallback]]
    fallback_from: NotRequired[str]
    deployment_of: NotRequired[str]
    # workers whose engine failed the task before its first token, and the last failure
    failed_workers: NotRequired[list[str]]
    failure: NotRequired[ErrorInfo | None]
    # set by route when the model asked for routes by meaning (workers/route/meaning.py)
    meaning: NotRequired[MeaningDecision | None]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: NotRequired[int]


class ErrorInfo(TypedDict):
    status: int
    type: str
    code: str | None
    param: str | None
    message: str


class Request(TypedDict):
    envelope: Envelope
    generation: Generation


class Prepared(TypedDict):
    envelope: Envelope
    generation: Generation
    prompt: Prompt


class Task(TypedDict):
    envelope: Envelope
    generation: Generation
    prompt: Prompt
    route: Route


class ChunkHeader(TypedDict):
    kind: Literal["chat", "completion", "embedding"]
    model: str
    created: int
    stop: list[str]
    stream: bool
    include_usage: bool
    prompt_tokens: int
    tool_calls: NotRequired[bool]  # the answer is read for tool calls (schemas/tools.py)
    logprobs: NotRequired[bool]  # the tokens' log probabilities were asked for
    asked: NotRequired[str]  # the model asked for, when another answers ("" when it does)
    encoding_format: NotRequired[str]  # kind embedding: float | base64


class TokenChunk(TypedDict):
    envelope: Envelope
    seq: int
    text: str
    tokens: int
    finish_reason: str | None
    worker_id: str
    header: ChunkHeader | None
    error: ErrorInfo | None
    run_id: str
    run_start: int
    cached_tokens: NotRequired[int | None]
    logprobs: NotRequired[list[TokenLogprob]]
    embeddings: NotRequired[list[Embedding]]  # kind embedding: the inputs' vectors


class Embedding(TypedDict):
    index: int  # the input's position in the request
    vector: bytes  # float32, little-endian


class TokenBatch(TypedDict):
    chunks: list[TokenChunk]


class Reply(TypedDict):
    envelope: Envelope
    index: int
    kind: Literal["delta", "final", "error"]
    text: str
    chunk: str
    finish_reason: str | None
    usage: Usage | None
    error: ErrorInfo | None
    logprobs: NotRequired[list[TokenLogprob]]
    cached: NotRequired[bool]  # from the prompt cache, not a worker


class ReplyBatch(TypedDict):
    replies: list[Reply]


class Control(TypedDict):
    request_id: str
    action: Literal["cancel"]
    reason: str
    ts_ms: int


class KvCache(TypedDict):
    usage: float
    total_blocks: int
    free_blocks: int
    cached_blocks: int | None
    block_tokens: int
    prefix_queries: int
    prefix_hits: int


class HostCache(TypedDict):
    held_bytes: int
    entries: int
    saved: int
    restored: int
    evicted: int


class ModelRegistry(TypedDict):
    text: str
    digest: str
    source: str
    applied_by: str
    ts_ms: int


class PolicyDocument(TypedDict):
    scope: str
    text: str
    digest: str
    source: str
    applied_by: str
    ts_ms: int


class BreakerState(TypedDict):
    worker_id: str
    pool: str
    state: Literal["closed", "open", "half_open"]
    failures: int
    until_ms: int
    reason: str
    ts_ms: int


class WorkerHeartbeat(TypedDict):
    worker_id: str
    pool: str
    engine: str
    models: list[str]
    loaded: NotRequired[list[str]]  # of models, those loaded now; empty: all of them
    state: Literal["ready", "draining", "stopped"]
    partitions: list[int]
    capacity: int
    running: int
    queued: int
    ts_ms: int
    host: str
    gpu_utilization: float | None
    gpu_memory_free: int | None
    kv: NotRequired[KvCache | None]
    interactive_running: int
    interactive_ms: int  # when it last took an interactive task (its clock); 0: never
    prefill_tps: NotRequired[float | None]  # measured: uncached prompt tokens a second
    tpot_ms: NotRequired[float | None]  # measured: milliseconds a token after the first
    # the prompt blocks its KV cache holds, most recent last (None: it does not say)
    prefix_blocks: NotRequired[list[int] | None]
    host_cache: NotRequired[HostCache | None]  # the llama.cpp engines' (None: none kept)


class DeadLetter(TypedDict):
    layer: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    ts_ms: int


class UsageRecord(TypedDict):
    request_id: str
    tenant: str
    key_id: str
    model: str
    kind: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    entered_ms: int
    finished_ms: int
    first_token_ms: NotRequired[int | None]  # None when no token came (v1 had none)
    error_code: NotRequired[str | None]  # the code of the error that ended it (v3)
    asked_model: NotRequired[str]  # the model asked for, when another answered (v3)


class Feedback(TypedDict):
    request_id: str
    tenant: str
    key_id: str
    score: float  # -1 (bad) to 1 (good)
    labels: list[str]
    comment: str
    model: str  # asked for
    answered_by: str  # a canary's deployment or a fallback; "" when it did not end
    latency_ms: int | None
    ts_ms: int


class AuditEvent(TypedDict):
    ts_ms: int
    action: str
    tenant: str
    key_id: str
    hash_prefix: str
    actor: str
    reason: str
    request_id: str
    detail: dict[str, str]


class ApiKey(TypedDict):
    id: str
    tenant: str
    name: str
    hash: str
    rpm: int | None
    tpm: int | None
    concurrency: int | None
    models: list[str]
    created_ms: int
    expires_ms: int
    revoked_ms: int
    version: int


class TenantPolicy(TypedDict):
    name: str
    rpm: int | None
    tpm: int | None
    concurrency: int | None
    daily_tokens: int | None
    monthly_tokens: int | None
    version: int


class JobCommand(TypedDict):
    job_id: str
    kind: Literal["batch", "response"]
    action: Literal["create", "cancel"]
    tenant: str
    key_id: str
    ts_ms: int
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str]
    generation: Generation | None
    models: list[str]
    body: str


class JobStatus(TypedDict):
    job_id: str
    kind: Literal["batch", "response"]
    tenant: str
    version: int
    ts_ms: int
    object: str


class JobResult(TypedDict):
    job_id: str
    event: Literal["result", "expanded", "invalid", "cancel"]
    request_id: str
    job_item: str
    status_code: int
    body: str
    error: ErrorInfo | None
    text: str
    finish_reason: str | None
    usage: Usage | None
    detail: str
    ts_ms: int
