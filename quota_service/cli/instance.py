"""`kvquota instance register`: register an instance from its live engine."""

from __future__ import annotations

import argparse

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel
from quota_service.cli.formatting import as_dict, print_json, print_rows
from quota_service.cli.listing import instance_row
from quota_service.config import Settings


def add_parsers(add_parser: AddParser) -> None:
    instance = add_parser("instance", help="manage one instance")
    instance_commands = instance.add_subparsers(dest="action", required=True)
    register = instance_commands.add_parser(
        "register", help="register an instance from its live vLLM engine"
    )
    register.add_argument("name", help="the instance id, e.g. gpu-0")
    register.add_argument("--vllm-url", required=True, help="vLLM's HTTP server")
    register.add_argument("--kv-events", help="vLLM's KV-event publisher, e.g. tcp://host:5557")
    register.add_argument("--kv-replay", help="its replay socket, e.g. tcp://host:5558")
    register.add_argument("--model", help="the model name (default: what the engine serves)")
    register.add_argument(
        "--lmcache-coordinator",
        help="the LMCache MP coordinator of its CPU tier, e.g. http://host:9300",
    )
    register.add_argument("--lmcache-instance-id", help="its MP server's --instance-id")
    register.add_argument("--lmcache-model", help="the model name its KV is stored under")
    register.add_argument("--max-model-len", type=int, help="default: the engine's")
    add_server_options(register)
    add_json_option(register)
    register.set_defaults(run=run_register)


def run_register(args: argparse.Namespace, settings: Settings) -> int:
    """Register an instance from its live engine: the engine reports its real pool."""
    engine = resources_pb2.EngineEndpoints(
        url=args.vllm_url,
        kv_events_endpoint=args.kv_events or "",
        kv_replay_endpoint=args.kv_replay or "",
    )
    if args.lmcache_coordinator:
        engine.lmcache.CopyFrom(
            resources_pb2.LmcacheEndpoint(
                coordinator_url=args.lmcache_coordinator,
                instance_id=args.lmcache_instance_id or "",
                model_name=args.lmcache_model or "",
            )
        )
    request = admin_pb2.RegisterInstanceRequest(
        instance_id=args.name,
        model=args.model or "",
        max_model_len=args.max_model_len or 0,
        engine=engine,
    )
    with channel(args) as chan:
        instance = admin_pb2_grpc.AdminServiceStub(chan).RegisterInstance(request, timeout=60)
    if args.json:
        print_json(as_dict(instance))
    else:
        print_rows([instance_row(instance)])
    return 0
