"""`kvquota plan`: the capacity plan for one engine (core/capacity.py), as tables or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.formatting import format_size, parse_size, print_json, print_rows
from quota_service.config import Settings
from quota_service.core import capacity, geometry


def add_parsers(add_parser: AddParser) -> None:
    plan = add_parser("plan", help="plan an engine's KV capacity from a model config")
    plan.add_argument("--config", required=True, help="the model's Hugging Face config.json")
    plan.add_argument("--gpu-memory", type=parse_size, help="e.g. 24GiB")
    plan.add_argument("--weights", type=parse_size, help="model weights, e.g. 16GiB")
    plan.add_argument("--overhead", type=parse_size, default=0, help="activations etc., e.g. 2GiB")
    plan.add_argument(
        "--utilization",
        type=float,
        default=geometry.VLLM_GPU_MEMORY_UTILIZATION,
        help="gpu_memory_utilization (default: vLLM's, %(default)s)",
    )
    plan.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        help="the KV cache's size outright, as vLLM's --kv-cache-memory-bytes (instead of "
        "--gpu-memory, --weights, --overhead and --utilization)",
    )
    plan.add_argument("--dtype", help="KV dtype (default: what vLLM's auto makes of the config's)")
    plan.add_argument(
        "--block-size",
        type=int,
        default=geometry.VLLM_BLOCK_SIZE,
        help="tokens per block (default: vLLM's on a GPU, %(default)s)",
    )
    plan.add_argument(
        "--context", type=int, nargs="+", default=[2048, 8192, 32768], help="context lengths"
    )
    plan.add_argument("--arrival-rate", type=float, help="requests per second to serve")
    plan.add_argument("--request-seconds", type=float, help="mean time a request is held")
    plan.add_argument("--ttft", type=float, help="target time to first token, seconds")
    plan.add_argument("--prefill-rate", type=float, help="prefill tokens per second")
    add_json_option(plan, "tables")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace, settings: Settings) -> int:
    try:
        config = json.loads(Path(args.config).read_text())
        dtype = geometry.parse_dtype(args.dtype) if args.dtype else None
        kv = geometry.geometry_from_hf_config(config, dtype)
        budget: geometry.KvBudget
        if args.kv_cache_memory is not None:
            budget = geometry.KvCacheBytes(args.kv_cache_memory)
        elif args.gpu_memory is None or args.weights is None:
            raise geometry.GeometryError("give --gpu-memory and --weights, or --kv-cache-memory")
        else:
            budget = geometry.MemoryBudget(
                args.gpu_memory, args.weights, args.overhead, args.utilization
            )
        plan = capacity.plan_capacity(
            kv,
            budget,
            args.block_size,
            args.context,
            args.arrival_rate,
            args.request_seconds,
            args.ttft,
            args.prefill_rate,
            dtype,
        )
    except (OSError, ValueError) as exc:  # GeometryError and bad JSON are ValueErrors
        print(f"kvquota plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json(dataclasses.asdict(plan))
        return 0
    print_rows(
        [
            {"figure": "KV bytes per token", "value": format_size(plan.bytes_per_token)},
            {"figure": "KV bytes per block", "value": format_size(plan.bytes_per_block)},
            {"figure": "KV cache", "value": format_size(plan.kv_bytes)},
            {"figure": "tokens", "value": plan.tokens},
            {"figure": "blocks (vLLM's num_gpu_blocks)", "value": plan.blocks},
            {"figure": "blocks for requests (less the null block)", "value": plan.usable_blocks},
            {
                "figure": "concurrency needed (Little's law)",
                "value": "-" if plan.needed_concurrency is None else plan.needed_concurrency,
            },
        ]
    )
    print()
    print_rows(
        [
            {
                "context": f.context_tokens,
                "blocks per request": f.blocks_per_request,
                "requests at once": f.max_concurrency,
            }
            for f in plan.fits
        ]
    )
    print()
    print(f"vLLM: vllm serve MODEL {' '.join(plan.vllm_args)}")
    if plan.max_num_queued_tokens is not None:
        print(f"kvquota instance: max_num_queued_tokens {plan.max_num_queued_tokens}")
    return 0
