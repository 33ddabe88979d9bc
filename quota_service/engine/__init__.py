"""Engine drivers for the GPU hosts (vLLM, LMCache, a simulated host) live here."""
