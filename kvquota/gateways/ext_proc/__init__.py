"""kvquota as an Envoy external processor (envoy.service.ext_proc.v3): `kvquota gateway envoy`.
mapping.py reads a request's tenant, priority and engine from what Envoy sends; processor.py
is the gRPC service."""
