"""The external processor: one `Process` stream per HTTP request through Envoy.

Envoy is configured (examples/envoy/envoy.yaml) to send the request headers, the buffered
request body, the response headers and the streamed response body. Per request:

- request body: parse the OpenAI request, read tenant, priority, engine and request id,
  tokenize, Admit. Admitted: the body gets the tenant's cache_salt, the request id and an
  output limit, and content-length follows. Refused: an immediate OpenAI-style error with
  kvquota's HTTP status and retry-after; nothing reaches the engine.
- while the answer streams the reservation's lease is renewed (kvquota.client).
- response body: `usage` is read from the stream. At end_of_stream a successful answer is
  Released with its output tokens; an error answer is Cancelled (the engine may still be running
  what Envoy gave up on: Cancel aborts it). A stream that ends before the answer did (the client
  went away, Envoy reset the request) is Cancelled, which aborts the generation in vLLM.

It runs beside Envoy as its own process rather than inside the kvquota server: it scales with
the gateway's replicas, loads the models' tokenizers (which the server has no use for), and
reaches kvquota with a gateway's API key like any other gateway.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvquota.client import AsyncKvquotaClient, KvquotaError, Reservation, current_request_id
from kvquota.gateways import openai_requests
from kvquota.gateways.admission import Admissions
from kvquota.gateways.config import ConfigError, GatewayConfig
from kvquota.gateways.ext_proc import mapping
from kvquota.gateways.openai_requests import BadLlmRequest
from kvquota.gateways.openai_responses import UsageReader, error_body, refusal_body

log = logging.getLogger(__name__)

ADMITTED_PATHS = frozenset({openai_requests.CHAT_PATH, openai_requests.COMPLETIONS_PATH})


class StreamEnded(Exception):
    """Envoy closed the stream before the answer's end: the client or Envoy gave up on it."""


def _headers(message: base_pb2.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): h.raw_value.decode(errors="replace") or h.value for h in message.headers}


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> ext_proc.ProcessingResponse:
    """An answer Envoy sends its client at once, in place of the engine's."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[
            _header("content-type", "application/json"),
            *(_header(k, v) for k, v in headers.items()),
        ]
    )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=body,
        )
    )


async def _cancel(reservation: AsyncExitStack) -> None:
    await reservation.__aexit__(StreamEnded, StreamEnded(), None)


def _path(headers: Mapping[str, str]) -> str:
    return headers.get(":path", "").split("?")[0]


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, config: GatewayConfig, client: AsyncKvquotaClient) -> None:
        self._config = config
        self._admissions = Admissions(config)
        self._client = client

    async def Process(self, requests: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # The reservation, once admitted, lives in this stack: leaving it normally releases,
        # leaving it with an exception (a cancelled task included) cancels.
        async with AsyncExitStack() as reservation:
            try:
                await self._exchange(context, reservation)
            except StreamEnded:
                await _cancel(reservation)

    async def _read(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ext_proc.ProcessingRequest:
        message = await context.read()
        if message is grpc.aio.EOF:
            raise StreamEnded
        assert isinstance(message, ext_proc.ProcessingRequest)
        return message

    async def _exchange(
        self, context: grpc.aio.ServicerContext[Any, Any], reservation: AsyncExitStack
    ) -> None:
        """Answers each message of one HTTP request, in order (see the module's docstring)."""
        write = context.write
        held: Reservation | None = None
        headers: dict[str, str] = {}
        metadata: dict[str, Any] = {}
        usage: UsageReader | None = None
        succeeded = False
        while True:
            try:
                message = await self._read(context)
            except StreamEnded:
                if held is None:
                    return  # nothing admitted: nothing to give back
                raise
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers = _headers(message.request_headers.headers)
                metadata = {
                    namespace: json_format.MessageToDict(struct)
                    for namespace, struct in message.metadata_context.filter_metadata.items()
                }
                await write(ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()))
            elif kind == "request_body":
                admitted = await self._admit(
                    headers, metadata, message.request_body.body, reservation
                )
                if isinstance(admitted, ext_proc.ProcessingResponse):
                    await write(admitted)  # refused: Envoy answers the client, the stream ends
                    return
                held, answer = admitted
                await write(answer)
            elif kind == "response_headers":
                answer_headers = _headers(message.response_headers.headers)
                succeeded = answer_headers.get(":status", "").startswith("2")
                event_stream = answer_headers.get("content-type", "").startswith(
                    "text/event-stream"
                )
                usage = UsageReader(event_stream)
                if message.response_headers.end_of_stream and held is not None:
                    await self._end(reservation, held, usage, succeeded)
                await write(
                    ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
                )
            elif kind == "response_body":
                body = message.response_body
                if usage is not None:
                    usage.feed(body.body)
                if body.end_of_stream and held is not None and usage is not None:
                    # Before the last chunk goes on: the client sees the end only once the
                    # blocks are given back.
                    await self._end(reservation, held, usage, succeeded)
                    held = None
                await write(ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse()))
            elif kind == "request_trailers":
                await write(
                    ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
                )
            elif kind == "response_trailers":
                await write(
                    ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
                )

    async def _end(
        self, reservation: AsyncExitStack, held: Reservation, usage: UsageReader, succeeded: bool
    ) -> None:
        usage.finish()
        if succeeded:
            held.output_tokens = usage.completion_tokens or 0
            await reservation.aclose()  # Release
        else:
            await _cancel(reservation)

    async def _admit(
        self,
        headers: Mapping[str, str],
        metadata: Mapping[str, Any],
        raw_body: bytes,
        reservation: AsyncExitStack,
    ) -> tuple[Reservation, ext_proc.ProcessingResponse] | ext_proc.ProcessingResponse:
        """The admitted request's body for the engine, or the immediate answer that refuses it."""
        path = _path(headers)
        if path not in ADMITTED_PATHS:
            return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
        request_id = headers.get(mapping.REQUEST_ID_HEADER) or uuid.uuid4().hex
        current_request_id.set(request_id)
        envoy = self._config.envoy
        try:
            body, request = openai_requests.parse_body(path, raw_body)
            tenant = mapping.tenant(envoy, headers, metadata)
            prompt_token_ids = await asyncio.to_thread(self._admissions.prompt_token_ids, request)
            admit = self._admissions.admit_request(
                request,
                tenant=tenant,
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                priority=mapping.priority(envoy, headers),
                engine_address=mapping.engine_address(envoy, headers),
            )
            held = await reservation.enter_async_context(self._client.reservation(admit))
        except mapping.UnknownTenant as unknown:
            return immediate(401, error_body(401, str(unknown), "TENANT_UNKNOWN"), {})
        except BadLlmRequest as bad:
            return immediate(400, error_body(400, str(bad), "INVALID_REQUEST"), {})
        except KvquotaError as refused:
            log.info("refused %s: %s", request_id, refused)
            return immediate(refused.http_status, refusal_body(refused), refused.headers)
        admitted = openai_requests.admitted_body(
            body,
            request,
            cache_salt=held.cache_salt,
            request_id=request_id,
            max_tokens=self._admissions.max_tokens(request),
        )
        encoded = openai_requests.encode(admitted)
        answer = ext_proc.ProcessingResponse(
            request_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(
                    header_mutation=ext_proc.HeaderMutation(
                        set_headers=[_header("content-length", str(len(encoded)))]
                    ),
                    body_mutation=ext_proc.BodyMutation(body=encoded),
                )
            )
        )
        return held, answer


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM or SIGINT, then finish the streams in flight (their answers end,
    or Envoy resets them and they are cancelled)."""
    if not (config.envoy.tenant_header or config.envoy.tenant_metadata):
        raise ConfigError("envoy: set tenant_header or tenant_metadata")
    async with AsyncKvquotaClient(list(config.kvquota), api_key=config.api_key) as client:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(config, client), server
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(config.envoy.listen)
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("kvquota's Envoy external processor listens on port %d", port)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=30)
