"""kvquota: a multi-tenant KV-cache quota service for fleets of vLLM engines."""
