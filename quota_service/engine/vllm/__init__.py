"""The vLLM driver: KV-cache events over ZMQ, /metrics, and the dev-mode control endpoints."""
